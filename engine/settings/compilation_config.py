"""vLLM's optimization level (``-O0``..``-O3``, ``--optimization-level``) and compilation
config (``--compilation-config JSON``, ``-cc JSON``, or its keys one by one,
``-cc.cudagraph_mode=NONE``) as kvledger reads them.

kvledger has no torch.compile to tune, but it captures decode steps as CUDA graphs, and
these flags say whether and which, as in vLLM 0.32 (``vllm/config/vllm.py``,
``vllm/config/compilation.py``):

- ``-O0`` captures no CUDA graphs (vLLM's ``OPTIMIZATION_LEVEL_00``: ``cudagraph_mode``
  NONE): ``--enforce-eager``. ``-O1``..``-O3`` capture them (PIECEWISE or
  FULL_AND_PIECEWISE there), as kvledger does anyway: no change.
- ``cudagraph_mode``: NONE is ``--enforce-eager``; any other mode captures, as kvledger
  does. Given, it wins over the level's, as vLLM applies a level's defaults only to the
  keys left unset; ``--enforce-eager`` wins over both, as vLLM's.
- ``cudagraph_capture_sizes`` and ``max_cudagraph_capture_size`` are
  ``--cudagraph-capture-sizes`` and ``--max-cudagraph-capture-size``; each with its flag
  is refused, as vLLM refuses the pair (``EngineArgs.create_engine_config``).
- Its other keys tune torch.compile and change nothing. A key vLLM 0.32's
  ``CompilationConfig`` does not have is refused (its fields forbid extras), except
  ``level``, the older vLLM's name of ``mode``, still in published launch lines.
"""

from __future__ import annotations

from typing import Any

from kvledger.engine import json_text
from kvledger.engine.errors import BadInput, clip, shown

LEVELS = (0, 1, 2, 3)  # vLLM's OptimizationLevel
CUDAGRAPH_MODES = ("NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")
_MODE_VALUES = {0: "NONE", 1: "PIECEWISE", 2: "FULL"}  # CUDAGraphMode's plain values
# vLLM 0.32's CompilationConfig fields a user may set, and the older "level".
FIELDS = frozenset({
    "mode", "debug_dump_path", "cache_dir", "compile_cache_save_format", "backend",
    "custom_ops", "ir_enable_torch_wrap", "splitting_ops", "compile_mm_encoder",
    "cudagraph_mm_encoder", "encoder_cudagraph_token_budgets",
    "encoder_cudagraph_max_vision_items_per_batch", "encoder_cudagraph_max_frames_per_batch",
    "cudagraph_decoder_replay", "decoder_replay_cudagraph_capture_sizes",
    "decoder_replay_trim_threshold", "compile_sizes", "compile_ranges_endpoints",
    "inductor_compile_config", "inductor_passes", "cudagraph_mode",
    "cudagraph_num_of_warmups", "cudagraph_capture_sizes", "cudagraph_copy_inputs",
    "cudagraph_specialize_lora", "use_inductor_graph_partition", "pass_config",
    "max_cudagraph_capture_size", "dynamic_shapes_config", "fast_moe_cold_start", "level",
})
_FLAG = "--compilation-config"
# The size keys kvledger reads -> their flags (each key is its flag's setting field too).
SIZE_KEYS = {"cudagraph_capture_sizes": "--cudagraph-capture-sizes",
             "max_cudagraph_capture_size": "--max-cudagraph-capture-size"}


def optimization_level(text: str) -> int:
    """argparse type of ``--optimization-level`` (``-O3``): 0, 1, 2 or 3, as vLLM's
    ``OptimizationLevel`` takes them; BadInput, one line, for anything else."""
    if text.strip() in {str(level) for level in LEVELS}:
        return int(text)
    raise BadInput(f"--optimization-level {clip(text)}: vLLM's optimization levels are "
                   "0, 1, 2 and 3 (-O0 captures no CUDA graphs, as --enforce-eager)")


def compilation_config(text: str) -> dict[str, Any]:
    """argparse type of ``--compilation-config``: a JSON object of vLLM's keys, the keys
    kvledger reads checked (``cudagraph_mode`` as its upper-case name); BadInput, one
    line, for anything else."""
    try:
        config = json_text.loads(text)
    except ValueError as exc:
        raise BadInput(f"{_FLAG} {clip(text)}: expected a JSON object of vLLM's compilation "
                       f"config ({exc})") from None
    if not isinstance(config, dict):
        raise BadInput(f"{_FLAG} {clip(text)}: expected a JSON object of vLLM's compilation "
                       "config, e.g. '{\"cudagraph_mode\": \"NONE\"}'")
    unknown = sorted(set(config) - FIELDS)
    if unknown:
        raise BadInput(f"{_FLAG}: vLLM 0.32's compilation config has no key "
                       f"{shown(unknown[0])}")
    config = {**config}
    if config.get("cudagraph_mode") is not None:
        config["cudagraph_mode"] = _mode(config["cudagraph_mode"])
    if config.get("cudagraph_capture_sizes") is not None:
        config["cudagraph_capture_sizes"] = _sizes(config["cudagraph_capture_sizes"])
    if config.get("max_cudagraph_capture_size") is not None:
        config["max_cudagraph_capture_size"] = _size(config["max_cudagraph_capture_size"],
                                                     "max_cudagraph_capture_size")
    return config


def graph_settings(values: dict[str, Any], level: int | None,
                   compilation: dict[str, Any] | None) -> dict[str, Any]:
    """The CUDA-graph settings of ``values`` (flags read so far, by field name) once the
    optimization level and the compilation config are applied; BadInput, one line, for a
    key given with its flag too."""
    compilation = compilation or {}
    out: dict[str, Any] = {}
    mode = compilation.get("cudagraph_mode")
    graphs_off = mode == "NONE" if mode is not None else level == 0
    if graphs_off and not values.get("enforce_eager"):
        out["enforce_eager"] = True
    for key, flag in SIZE_KEYS.items():  # each key is its flag's field
        if compilation.get(key) is None:
            continue
        if values.get(key) is not None:
            raise BadInput(f"{flag} and {_FLAG}'s {key} are mutually exclusive (as in "
                           "vLLM): give one")
        out[key] = compilation[key]
    return out


def _mode(value: Any) -> str:
    if isinstance(value, str) and value.upper() in CUDAGRAPH_MODES:
        return value.upper()
    if isinstance(value, int) and not isinstance(value, bool) and value in _MODE_VALUES:
        return _MODE_VALUES[value]
    raise BadInput(f"{_FLAG}: cudagraph_mode must be one of {', '.join(CUDAGRAPH_MODES)}, "
                   f"got {shown(value)}")


def _size(value: Any, key: str) -> int:
    # vLLM's pydantic reads "8" as 8 (what `-cc.cudagraph_capture_sizes+ 1,2,4` gives).
    if isinstance(value, str) and value.isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise BadInput(f"{_FLAG}: {key} must be positive integers, got {shown(value)}")
    return value


def _sizes(value: Any) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise BadInput(f"{_FLAG}: cudagraph_capture_sizes must be a list of positive "
                       f"integers, got {shown(value)}")
    return tuple(_size(v, "cudagraph_capture_sizes") for v in value)
