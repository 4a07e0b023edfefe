"""Load a checkpoint's safetensors (single file or sharded with an index) into CausalLM."""

from __future__ import annotations

import contextlib
import itertools
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from kvledger.engine.checkpoint.files import checkpoint_files
from kvledger.engine.checkpoint.fp8_format import (
    KV_SCALE_SUFFIXES,
    SCALE_SUFFIXES,
    quantized_linear,
)
from kvledger.engine.checkpoint.gemma_config import language_model_name
from kvledger.engine.checkpoint.loadable import IGNORED_SUFFIXES, loaded_names
from kvledger.engine.checkpoint.model_config import ModelConfig
from kvledger.engine.checkpoint.phi3_weights import fused_shape, split_names, split_rows
from kvledger.engine.checkpoint.read_ahead import (
    AS_VLLM_DEFAULTS,
    ReadAhead,
    WeightReading,
    prefetches,
    read_whole,
)
from kvledger.engine.checkpoint.weight_formats import WEIGHT_FORMATS
from kvledger.engine.errors import BadInput
from kvledger.engine.model.fp8_linear import (
    FP8_DTYPE,
    install_fp8_linears,
    quantize_weight,
    scale_shape,
)
from kvledger.engine.model.gemma import GemmaCausalLM
from kvledger.engine.model.int4_linear import install_int4_linears
from kvledger.engine.model.mapped_file import MappedFile
from kvledger.engine.model.pipeline import Stage, StageLM
from kvledger.engine.model.transformer import CausalLM
from kvledger.engine.planner.device import host_available_bytes


@dataclass(frozen=True)
class Weights:
    """Where a model's weights come from and how they are read (``load_model``'s
    arguments), kept so they can be read again (sleep mode's level 2, ``core/sleep.py``)."""

    model_dir: str | Path
    config: ModelConfig
    dtype: torch.dtype
    device: torch.device
    quantize_fp8: bool = False
    reading: WeightReading = AS_VLLM_DEFAULTS

    def load(self) -> CausalLM:
        return load_model(self.model_dir, self.config, self.dtype, self.device,
                          quantize_fp8=self.quantize_fp8, reading=self.reading)


# The initializers torch's layers call in __init__. On the meta device they compute
# nothing, but the first of them imports torch's reference ops (torch._refs): about a
# second of every start (and of every wake from sleep level 2) for values the checkpoint
# replaces anyway.
_INITIALIZERS = ("uniform_", "normal_", "trunc_normal_", "kaiming_uniform_",
                 "kaiming_normal_", "xavier_uniform_", "xavier_normal_", "zeros_", "ones_",
                 "constant_")


@contextlib.contextmanager
def _no_init() -> Iterator[None]:
    """torch.nn.init's initializers as no-ops while the model is built on the meta device."""
    saved = {name: getattr(torch.nn.init, name) for name in _INITIALIZERS}
    try:
        for name in _INITIALIZERS:
            setattr(torch.nn.init, name, _unchanged)
        yield
    finally:
        for name, initializer in saved.items():
            setattr(torch.nn.init, name, initializer)


def _unchanged(tensor: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
    return tensor


def load_model(model_dir: str | Path, config: ModelConfig, dtype: torch.dtype,
               device: torch.device, *, quantize_fp8: bool = False,
               stage: Stage | None = None,
               reading: WeightReading = AS_VLLM_DEFAULTS) -> CausalLM | StageLM:
    """Build the model on the meta device, then assign the checkpoint's tensors in ``dtype``
    on ``device``: no random init, no second copy of the weights. An FP8 checkpoint's
    weights stay FP8 and its scales float32, in ``Fp8Linear`` layers; a 4-bit checkpoint's
    (GPTQ, AWQ, W4A16) tensors stay as stored, in ``Int4Linear`` layers; ``quantize_fp8``
    (``--quantization fp8``) quantizes an unquantized checkpoint's linear layers so, each
    as it is read (the whole model is never held unquantized). With a pipeline ``stage``
    only that stage's tensors are read (``model/pipeline.py``), into a ``StageLM``. The files
    are read as ``reading`` says (``checkpoint/read_ahead.py``: ahead in the background, each
    whole before its tensors, or as the memory map takes them)."""
    model_dir = Path(model_dir)
    with _no_init(), torch.device("meta"):
        model = model_class(config)(config) if stage is None else StageLM(config, stage)
    files = checkpoint_files(model_dir)
    present = [path for path in files if os.path.isfile(path)]
    ahead = (ReadAhead(present, reading).start()
             if prefetches(reading, present, host_available_bytes()) else None)
    try:
        state = _read_state(files, config, dtype, device, quantize_fp8, stage, reading)
    finally:
        if ahead is not None:  # no read outlives the load
            ahead.join()
    kv_scales = {name: state.pop(name) for name in list(state) if name.endswith(KV_SCALE_SUFFIXES)}
    served = WEIGHT_FORMATS.get(config.weight_format)
    if served is not None and served.packed:  # 4-bit layers, in their weights' stead
        install_int4_linears(model, state, served.name)
    else:  # FP8 weights, stored or quantized on load (none: nothing to install)
        install_fp8_linears(model, state)
    whole = stage is None or (stage.first and stage.last)
    if "lm_head.weight" not in state and config.tie_word_embeddings and whole:
        state["lm_head.weight"] = state.get("model.embed_tokens.weight")
    shapes = {name: t.shape for name, t in model.state_dict().items()}
    expected = set(shapes)
    missing = sorted(expected - {k for k, v in state.items() if v is not None})
    unexpected = sorted(set(state) - expected)
    if missing or unexpected:
        detail = f"missing {missing[:3]}" if missing else f"unexpected {unexpected[:3]}"
        raise BadInput(f"{model_dir}: checkpoint does not match {config.architecture}: {detail}")
    for name, tensor in state.items():
        want = shapes[name]
        if tensor.shape != want:
            raise BadInput(f"{model_dir}: {name} has shape {tuple(tensor.shape)}, config says {tuple(want)}")
    model.load_state_dict(state, assign=True)
    _set_kv_scales(model, kv_scales, model_dir)
    if config.tie_word_embeddings and whole:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval().requires_grad_(False)


def model_class(config: ModelConfig) -> type[CausalLM]:
    """The module that runs ``config``'s architecture: Gemma's (gemma.py), or the Llama
    family's."""
    return GemmaCausalLM if config.gemma is not None else CausalLM


def _read_state(files: list[Path], config: ModelConfig, dtype: torch.dtype,
                device: torch.device, quantize_fp8: bool, stage: Stage | None,
                reading: WeightReading) -> dict[str, torch.Tensor]:
    """Every tensor of ``files`` that the model (or ``stage``) holds, as ``_loaded`` gives
    it, from views of each file's memory map (``mapped_file.py``: read as they are used,
    in the file's order); with ``eager`` reading, each file read whole first."""
    state: dict[str, torch.Tensor] = {}
    for path in files:
        if not os.path.isfile(path):  # False for a name too long, never OSError
            raise BadInput(f"{path}: listed in the index but missing")
        try:
            if reading.strategy == "eager":
                read_whole(path, reading.block_bytes)
            mapped = MappedFile(path)
            for stored in mapped.names:
                # A multimodal checkpoint's language model, renamed; its vision tower: None.
                name = language_model_name(stored, config.architecture)
                if name is None or name.endswith(IGNORED_SUFFIXES) or (
                        stage is not None and not stage.holds(name, config)):
                    continue
                local = name if stage is None else stage.local_name(name, config)
                state.update(_loaded(local, mapped.tensor(stored), config, dtype, device,
                                     quantize_fp8))
        except (OSError, RuntimeError) as exc:
            raise BadInput(f"{path}: cannot read safetensors: {exc}") from None
    return state


def _loaded(name: str, tensor: torch.Tensor, config: ModelConfig, dtype: torch.dtype,
            device: torch.device, quantize_fp8: bool) -> dict[str, torch.Tensor]:
    """One stored tensor as the engine holds it, by the names it fills: floats in ``dtype``,
    FP8 weights as they are, scales in float32 (``scale_shape``); fused experts and Phi-3's
    fused projections split;
    with ``quantize_fp8`` each linear layer's weight in FP8 beside its ``weight_scale``;
    a 4-bit layer's tensors as stored (``int4_format``); KV cache scales as stored."""
    if name.endswith(KV_SCALE_SUFFIXES):
        return {name: tensor}
    served = WEIGHT_FORMATS.get(config.weight_format)
    if served is not None and served.kept_as_stored(name):
        return {name: tensor.to(device)}
    if name.endswith(SCALE_SUFFIXES):
        return {name: scale_shape(tensor).to(device)}
    if tensor.dtype == FP8_DTYPE:
        tensor = tensor.to(device)
    else:
        tensor = tensor.to(device=device, dtype=dtype)
    if split_rows(name, config) is not None:
        pieces = _split_fused_projection(name, tensor, config)
    elif config.moe is None:
        pieces = {name: tensor}
    else:
        pieces = _split_fused_experts({name: tensor}, config)
    if not quantize_fp8:
        return pieces
    out: dict[str, torch.Tensor] = {}
    for piece, weight in pieces.items():
        if quantized_linear(piece) and weight.dtype != FP8_DTYPE:
            out[piece], out[piece.removesuffix("weight") + "weight_scale"] = quantize_weight(weight)
        else:
            out[piece] = weight
    return out


def _set_kv_scales(model: CausalLM, scales: dict[str, torch.Tensor], model_dir: Path) -> None:
    """Each layer's ``k_scale`` / ``v_scale`` (one per tensor) onto its attention, as the
    numbers an fp8 KV cache is divided by when written and multiplied by when read."""
    for name, scale in scales.items():
        if scale.numel() != 1 or not scale.is_floating_point():
            raise BadInput(f"{model_dir}: {name} has shape {tuple(scale.shape)} as "
                           f"{scale.dtype}; kvledger reads one float KV scale per layer")
        attention, _, which = name.rpartition(".")
        value = float(scale.float().reshape(()))
        if not value > 0:
            raise BadInput(f"{model_dir}: {name} is {value}; a KV scale must be positive")
        setattr(model.get_submodule(attention), which, value)


def _split_fused_experts(state: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """Published MoE checkpoints name each expert's tensors (``experts.{i}.gate_proj``;
    Mixtral's ``block_sparse_moe.experts.{i}.w1``); transformers 5 saves them fused when
    asked to (``save_original_format=False``), the router as ``mlp.gate.weight``. Split
    those into per-expert views (no copy), named as ``loaded_names`` says, which is also
    what the pre-flight checks the headers against."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        names = loaded_names(name, tuple(tensor.shape), config)
        if len(names) == 1:
            out[names[0]] = tensor
        elif len(names) == tensor.shape[0]:  # [experts, hidden, inter]: each expert's down
            out.update(zip(names, tensor.unbind(0), strict=True))
        else:  # gate_up_proj, [experts, 2 * inter, hidden]: each expert's gate, then up
            halves = (half for matrix in tensor for half in matrix.chunk(2))
            out.update(zip(names, halves, strict=True))
    return out


def _split_fused_projection(name: str, tensor: torch.Tensor,
                            config: ModelConfig) -> dict[str, torch.Tensor]:
    """Phi-3's ``qkv_proj`` into q, k and v, ``gate_up_proj`` into gate and up: row views of
    the stored tensor, named as ``loaded_names`` says (``phi3_weights``)."""
    want = fused_shape(name, config)
    if tuple(tensor.shape) != want:
        raise BadInput(f"{name} has shape {tuple(tensor.shape)}, config says {want}")
    rows = split_rows(name, config)
    return dict(zip(split_names(name, config), tensor.split(rows), strict=True))


def weights_bytes(model: CausalLM) -> int:
    """Bytes of the resident weights (parameters, and the packed weights the CPU's
    linear layers hold as buffers), a tied tensor counted once."""
    seen: set[int] = set()
    total = 0
    for t in itertools.chain(model.parameters(), model.buffers()):
        key = id(t) if t.is_mkldnn else t.data_ptr()  # an opaque oneDNN tensor has no pointer
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total
