"""A PEFT LoRA adapter's files (``adapter_config.json`` + ``adapter_model.safetensors``)
read without torch and without a byte of tensor data: whether it fits the base model and
the limits, refusing by name what the engine would run wrong (a rank over
``--max-lora-rank``, a module it cannot adapt, a tensor whose shape or dtype is not the
base layer's, PEFT options that change the maths: DoRA, biases, patterns; a ``lora_alpha``
that is not finite). The pre-flight checks every ``--lora-modules`` adapter with it, so a
pod fails in its init container with the reason; the engine's loader reads the same, then
the weights (``model/lora_adapter.py``).

The scaling is PEFT's: ``lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with ``use_rslora``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

from kvledger.engine import json_text
from kvledger.engine.checkpoint.contents import ModelShape
from kvledger.engine.checkpoint.hub.uri import is_hub_uri
from kvledger.engine.checkpoint.read_limits import MAX_CONFIG_BYTES
from kvledger.engine.checkpoint.safetensors_header import TensorInfo, read_safetensors_header
from kvledger.engine.errors import BadInput, shown
from kvledger.engine.planner.lora_bytes import LORA_TARGETS, adapter_elements, module_shapes
from kvledger.engine.settings.config import EngineConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PEFT_DEFAULT_ALPHA = 8  # peft.LoraConfig's lora_alpha when the file has none
FLOAT_DTYPES = ("F32", "F16", "BF16")  # what PEFT writes an adapter in
_TENSOR = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\."
                     r"(\w+)\.lora_([AB])\.weight$")


@dataclass(frozen=True)
class AdapterFiles:
    """What an adapter's files say: its rank and scaling, and each adapted ``(layer,
    module)``'s A and B tensor names in ``weights_path``."""

    rank: int
    scaling: float
    names: dict[tuple[int, str], tuple[str, str]]
    weights_path: Path


class AdapterNotFound(BadInput):
    """No adapter this server can read at the path: one message whatever the reason (no
    such directory, no adapter files, no permission), so a client naming paths learns
    nothing of the server's file system."""

    def __init__(self, where: str) -> None:
        super().__init__(f"{where}: not a PEFT LoRA adapter directory this server can read "
                         f"(it needs {CONFIG_FILE} and {WEIGHTS_FILE})")


def max_weights_bytes(config: ModelShape, max_lora_rank: int) -> int:
    """The largest ``adapter_model.safetensors`` an adapter of rank ``max_lora_rank`` on this
    model can be: every target of every layer in float32, plus a header's worth."""
    shapes = module_shapes(config.hidden_size, config.num_attention_heads, config.num_kv_heads,
                           config.head_dim, config.intermediate_size)
    return adapter_elements(shapes, config.num_layers, max_lora_rank) * 4 + 2**20


def read_adapter_files(where: str, directory: str | Path, shape: ModelShape,
                       max_lora_rank: int) -> AdapterFiles:
    """``directory``'s adapter checked against the base model ``shape`` (one rank's whole
    model) within ``max_lora_rank``, from its config and its safetensors header alone;
    BadInput naming ``where`` and the first thing that cannot run."""
    directory = Path(directory)
    raw = _read_config(directory, where)
    rank, scaling, targets = _check_config(raw, where, max_lora_rank)
    weights_path = directory / WEIGHTS_FILE
    try:
        if not weights_path.is_file():
            raise AdapterNotFound(where)
        size = weights_path.stat().st_size
    except OSError:
        raise AdapterNotFound(where) from None
    if size > (largest := max_weights_bytes(shape, max_lora_rank)):
        raise BadInput(f"{where}: {WEIGHTS_FILE} is {size} bytes; an adapter of rank at most "
                       f"{max_lora_rank} on this model is at most {largest}")
    shapes = module_shapes(shape.hidden_size, shape.num_attention_heads, shape.num_kv_heads,
                           shape.head_dim, shape.intermediate_size)
    names = _check_header(weights_path, where, shape, rank, targets, shapes)
    return AdapterFiles(rank, scaling, names, weights_path)


def check_adapters(config: EngineConfig, shape: ModelShape) -> None:
    """Every local ``--lora-modules`` adapter read as the engine will read it (``hf://``
    ones are read when the engine fetches them); BadInput naming the first that cannot
    run on this model within ``--max-lora-rank``."""
    for module in config.lora_modules if config.enable_lora else ():
        if not is_hub_uri(module.path):
            read_adapter_files(f"LoRA adapter {module.name!r} ({module.path})", module.path,
                               shape, config.max_lora_rank)


def _check_header(path: Path, where: str, config: ModelShape, rank: int, targets: set[str],
                  shapes: dict[str, tuple[int, int]]) -> dict[tuple[int, str], tuple[str, str]]:
    """Each adapted ``(layer, module)``'s A and B tensor names, every name, dtype and shape
    checked from the file's header alone; BadInput for the first that cannot run."""
    try:
        infos = read_safetensors_header(path)
    except BadInput as exc:
        raise BadInput(f"{where}: cannot read {WEIGHTS_FILE}: "
                       f"{str(exc).removeprefix(f'{path}: ')}") from None
    halves: dict[tuple[int, str, str], TensorInfo] = {}
    for info in infos:
        match = _TENSOR.match(info.name)
        if match is None or match[3] not in LORA_TARGETS or LORA_TARGETS[match[3]] != match[2]:
            raise BadInput(f"{where}: tensor {info.name!r} adapts nothing kvledger can "
                           f"adapt (the {', '.join(LORA_TARGETS)} projections)")
        layer, module = int(match[1]), match[3]
        if layer >= config.num_layers:
            raise BadInput(f"{where}: {info.name!r} is for layer {layer}; the base model "
                           f"has {config.num_layers}")
        if info.dtype not in FLOAT_DTYPES:
            raise BadInput(f"{where}: {info.name!r} is {info.dtype}; LoRA weights must be "
                           f"one of {', '.join(FLOAT_DTYPES)}")
        halves[layer, module, match[4]] = info
    names = {}
    for (layer, module, half), a in sorted(halves.items()):
        if half != "A":
            continue
        b = halves.get((layer, module, "B"))
        if b is None:
            raise BadInput(f"{where}: layer {layer} {module} has lora_A but no lora_B")
        fan_in, fan_out = shapes[module]
        if module not in targets:
            raise BadInput(f"{where}: layer {layer} {module} has weights but "
                           f"target_modules does not name it")
        if a.shape != (rank, fan_in) or b.shape != (fan_out, rank):
            raise BadInput(f"{where}: layer {layer} {module} has lora_A {a.shape} and "
                           f"lora_B {b.shape}; rank {rank} on this base model needs "
                           f"{(rank, fan_in)} and {(fan_out, rank)}")
        names[layer, module] = (a.name, b.name)
    orphans = sorted(k for k in halves if k[2] == "B" and (k[0], k[1]) not in names)
    if orphans:
        raise BadInput(f"{where}: layer {orphans[0][0]} {orphans[0][1]} has lora_B but no lora_A")
    if not names:
        raise BadInput(f"{where}: {WEIGHTS_FILE} holds no LoRA weights")
    return names


def _read_config(directory: Path, where: str) -> dict:
    path = directory / CONFIG_FILE
    try:
        if not path.is_file():  # a FIFO or a device would block or never end
            raise AdapterNotFound(where)
        with open(path, "rb") as f:
            text = f.read(MAX_CONFIG_BYTES + 1)
    except OSError:
        raise AdapterNotFound(where) from None
    if len(text) > MAX_CONFIG_BYTES:
        raise BadInput(f"{where}: {CONFIG_FILE} is over {MAX_CONFIG_BYTES} bytes")
    try:
        raw = json_text.loads(text)
    except ValueError as exc:
        raise BadInput(f"{where}: cannot read {CONFIG_FILE}: {exc}") from None
    if not isinstance(raw, dict):
        raise BadInput(f"{where}: {CONFIG_FILE} is not a JSON object")
    return raw


def _check_config(raw: dict, where: str, max_lora_rank: int) -> tuple[int, float, set[str]]:
    """``(rank, scaling, targeted modules)``, or BadInput naming what cannot run."""
    if raw.get("peft_type", "LORA") != "LORA":
        raise BadInput(f"{where}: peft_type {shown(raw['peft_type'])}; kvledger serves LORA adapters")
    rank = raw.get("r", 8)
    if isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0:
        raise BadInput(f"{where}: r must be a positive integer, got {shown(rank)}")
    if rank > max_lora_rank:
        raise BadInput(f"{where}: rank {rank} is over --max-lora-rank {max_lora_rank}")
    alpha = raw.get("lora_alpha", PEFT_DEFAULT_ALPHA)
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not math.isfinite(alpha):
        raise BadInput(f"{where}: lora_alpha must be a finite number, got {shown(alpha)}")
    refused = [(raw.get("use_dora"), "use_dora (DoRA)"),
               (raw.get("bias", "none") != "none", f"bias {shown(raw.get('bias'))}"),
               (raw.get("modules_to_save"), "modules_to_save"),
               (raw.get("fan_in_fan_out"), "fan_in_fan_out"),
               (raw.get("rank_pattern"), "rank_pattern"),
               (raw.get("alpha_pattern"), "alpha_pattern")]
    for given, what in refused:
        if given:
            raise BadInput(f"{where}: kvledger does not serve adapters with {what}")
    targets = raw.get("target_modules")
    if targets == "all-linear":
        targets = list(LORA_TARGETS)
    if (isinstance(targets, str) or not isinstance(targets, list) or not targets
            or not all(isinstance(t, str) for t in targets)):
        raise BadInput(f"{where}: target_modules must be a list of module names or "
                       f"\"all-linear\", got {shown(targets)}")
    unknown = sorted(str(t) for t in targets if t not in LORA_TARGETS)
    if unknown:
        raise BadInput(f"{where}: target module {unknown[0]!r} is not one kvledger adapts "
                       f"({', '.join(LORA_TARGETS)})")
    scaling = alpha / (math.sqrt(rank) if raw.get("use_rslora") else rank)
    return rank, float(scaling), set(targets)
