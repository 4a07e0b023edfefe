"""Whether kvledger's engine can load a checkpoint, told from its config.json and its
safetensors headers alone (torch-free, as the planner is, and before a byte of tensor data
is read).

``loadable_config`` is the one check that ``plan`` (for an architecture the engine serves),
``preflight``, ``run`` and ``serve`` make before anything is allocated or loaded: a
checkpoint the loader would refuse halfway through, or load wrong (quantized weights cast
as if they were values), is refused by name instead, so that a pod's pre-flight says why
rather than its engine crash-looping. The names the engine loads are the loader's too
(``loaded_names``, ``IGNORED_SUFFIXES``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from typing import Any

from kvledger.engine.checkpoint.contents import CASTABLE_DTYPES, TensorInfo
from kvledger.engine.checkpoint.fp8_format import KV_SCALE_SUFFIXES, quantized_linear
from kvledger.engine.checkpoint.gemma_config import language_model_name
from kvledger.engine.checkpoint.granite_moe_weights import granite_moe_names, stored_shape
from kvledger.engine.checkpoint.model_config import SERVED_WEIGHTS, ModelConfig
from kvledger.engine.checkpoint.phi3_weights import fused_shape, split_names
from kvledger.engine.checkpoint.tensor_shapes import (
    block,
    expert_projections,
    float_shapes,
    fused_expert_shape,
)
from kvledger.engine.checkpoint.weight_formats import WEIGHT_FORMATS
from kvledger.engine.errors import BadInput, some

# Buffers some older checkpoints carry that the engine recomputes.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
FUSED_EXPERTS = ".mlp.experts."  # transformers 5's fused experts: LAYER.mlp.experts.WHAT
_LAYER = re.compile(r"model\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.experts\.(\d+)\.")


def loadable_config(raw: Mapping[str, Any], tensors: Iterable[TensorInfo]) -> ModelConfig:
    """The engine's config of a checkpoint it can load, from config.json's object ``raw``
    and its safetensors headers' ``tensors``. BadInput, one line, naming why it cannot:
    what ``ModelConfig.from_dict`` refuses (the architecture, activation, RoPE, routing, a
    ``quantization_config``), tensors the loader would refuse as unexpected (the scales
    of weights quantized without a quantization_config, another model's tensors), and
    weights stored in a dtype that is not a float (the loader would cast them as values),
    but for an FP8 checkpoint's quantized weights (F8_E4M3 with a ``weight_scale``) and a
    4-bit checkpoint's packed layers (``int4_format``: all their tensors, ints as ints),
    and tensors whose shapes are not the ones config.json's widths give (``check_shapes``:
    the plan would be sized from widths the loader then refuses)."""
    config = ModelConfig.from_dict(raw)
    stored = [t for t in language_model(tensors, config.architecture)
              if not t.name.endswith(IGNORED_SUFFIXES)]
    _check_counts(stored, config)
    weight_format = WEIGHT_FORMATS.get(config.weight_format)
    quantized = weight_format.quantized_tensors(stored) if weight_format else set()
    shapes = float_shapes(config)  # the names and the shapes checked below, built once
    unexpected = unexpected_tensors(stored, config, shapes)
    if unexpected:
        raise BadInput(f"checkpoint has tensors kvledger's engine does not load for "
                       f"{config.architecture}: {some(unexpected)} (quantized weights and "
                       f"scales without a quantization_config, or another model's tensors); "
                       f"{SERVED_WEIGHTS}")
    packed = sorted(f"{t.name!r} as {t.dtype}" for t in stored
                    if t.dtype not in CASTABLE_DTYPES and t.name not in quantized)
    if packed:
        raise BadInput(f"checkpoint stores weights in a dtype that is not a float: "
                       f"{some(packed, quote=False)} (quantized weights?); {SERVED_WEIGHTS}")
    check_shapes(stored, config, shapes)
    return config


def language_model(tensors: Iterable[TensorInfo], architecture: str) -> list[TensorInfo]:
    """The tensors the engine loads of ``architecture``, by the engine's names: a
    multimodal checkpoint's language model (``gemma_config.language_model_name``), the
    rest as they are."""
    named = ((t, language_model_name(t.name, architecture)) for t in tensors)
    return [t if name == t.name else t._replace(name=name) for t, name in named
            if name is not None]


def check_shapes(stored: list[TensorInfo], config: ModelConfig,
                 expected: Mapping[str, tuple[int, ...]] | None = None) -> None:
    """BadInput, one line, when a stored tensor's shape is not the one the loader expects
    for ``config`` (``float_shapes``; fused experts as ``fused_expert_shape``; a quantized
    layer's scales and packed tensors as its format stores them; one number for each KV
    cache scale), naming the first few and config.json's widths. Run after the names are
    checked: a name the engine does not hold is refused as unexpected, not here."""
    expected = float_shapes(config) if expected is None else expected
    wrong = []
    for t in stored:
        if t.name.endswith(KV_SCALE_SUFFIXES):
            if math.prod(t.shape) != 1:
                wrong.append(f"{t.name!r} is {list(t.shape)}, expected one number")
            continue
        pieces = loaded_names(t.name, t.shape, config)
        want = (expected.get(pieces[0]) if len(pieces) == 1
                else fused_shape(t.name, config) or stored_shape(t.name, config)
                or fused_expert_shape(config, t.name.partition(FUSED_EXPERTS)[2]))
        if want is not None and t.shape != want:
            wrong.append(f"{t.name!r} is {list(t.shape)}, expected {list(want)}")
    weight_format = WEIGHT_FORMATS.get(config.weight_format)
    if weight_format is not None:
        stored_shapes = {t.name: t.shape for t in stored}
        wrong += weight_format.shape_errors(stored_shapes, expected)
    if wrong:
        raise BadInput(f"checkpoint's tensors do not have the shapes config.json gives: "
                       f"{some(wrong, quote=False)} (config.json: {_widths(config)})")


def _widths(config: ModelConfig) -> str:
    """The config.json fields the shapes come from, as a refusal quotes them."""
    widths = [f"hidden_size {config.hidden_size}", f"intermediate_size {config.intermediate_size}",
              f"num_attention_heads {config.num_attention_heads}",
              f"num_key_value_heads {config.num_kv_heads}", f"head_dim {config.head_dim}",
              f"vocab_size {config.vocab_size}"]
    if config.moe is not None:
        widths += [f"experts {config.moe.num_experts} of {config.moe.intermediate_size}"]
    return ", ".join(widths)


def _check_counts(stored: list[TensorInfo], config: ModelConfig) -> None:
    """BadInput when config.json declares more decoder layers, or experts, than the
    checkpoint stores: the loader would find them missing, after loading the rest."""
    layers = {int(m.group(1)) for t in stored if (m := _LAYER.match(t.name))}
    if len(layers) < config.num_layers:
        raise BadInput(f"config.json declares {config.num_layers} decoder layers; the "
                       f"checkpoint stores {len(layers)}")
    if config.moe is None:
        return
    experts = {int(m.group(1)) + 1 for t in stored if (m := _EXPERT.search(t.name))}
    experts |= {t.shape[0] for t in stored if FUSED_EXPERTS in t.name and len(t.shape) == 3}
    if experts and max(experts) < config.moe.num_experts:
        raise BadInput(f"config.json declares {config.moe.num_experts} experts per layer; the "
                       f"checkpoint stores {max(experts)}")


def unexpected_tensors(tensors: Iterable[TensorInfo], config: ModelConfig,
                       shapes: Mapping[str, tuple[int, ...]] | None = None) -> list[str]:
    """The names of the stored ``tensors`` the loader would refuse for ``config``, sorted:
    those that fill none of the engine's tensors (``loaded_names``, ``tensor_names``)."""
    expected = tensor_names(config, shapes) | kv_scale_names(config)
    # Most names are the engine's as they are; only the others may be renamed or split.
    others = (t for t in tensors if t.name not in expected)
    return sorted(t.name for t in others if not t.name.endswith(IGNORED_SUFFIXES)
                  and not expected.issuperset(loaded_names(t.name, t.shape, config)))


def tensor_names(config: ModelConfig,
                 shapes: Mapping[str, tuple[int, ...]] | None = None) -> frozenset[str]:
    """Every tensor the engine's model may hold for ``config``, named as Hugging Face's
    checkpoints name them (``float_shapes``); for an FP8 checkpoint, each quantized linear
    layer's scales too; for a 4-bit one, its packed tensors. ``shapes``: ``float_shapes``
    already built."""
    names = set(float_shapes(config) if shapes is None else shapes)
    weight_format = WEIGHT_FORMATS.get(config.weight_format)
    if weight_format is not None:  # a quantized layer's scales or packed tensors
        names |= {n for w in list(names) if quantized_linear(w)
                  for n in weight_format.layer_tensors(w)}
    return frozenset(names)


def kv_scale_names(config: ModelConfig) -> frozenset[str]:
    """Each layer's KV cache scales (``k_scale``, ``v_scale``; a ``kv_cache_scheme``), which
    the loader reads as numbers for ``--kv-cache-dtype fp8``, not as the model's tensors."""
    return frozenset(f"model.layers.{layer}{suffix}" for layer in range(config.num_layers)
                     for suffix in KV_SCALE_SUFFIXES)


def loaded_names(name: str, shape: tuple[int, ...], config: ModelConfig) -> tuple[str, ...]:
    """The engine's tensors a stored tensor fills, in the order the loader splits it: its
    own name; Phi-3's fused ``qkv_proj`` and ``gate_up_proj`` (``phi3_weights``); Granite-MoE's
    experts and router (``granite_moe_weights``);
    Mixtral's router saved as ``mlp.gate.weight``, renamed; or the experts that
    transformers 5 saves fused (``save_original_format=False``): ``mlp.experts.gate_up_proj``
    ``[experts, 2 * inter, hidden]`` is each expert's gate then up, ``mlp.experts.down_proj``
    ``[experts, hidden, inter]`` each expert's down."""
    if config.moe is None:
        return split_names(name, config) or (name,)
    granite = granite_moe_names(name, shape, config)
    if granite is not None:
        return granite
    layer, fused, what = name.partition(FUSED_EXPERTS)
    mixtral = config.architecture == "MixtralForCausalLM"
    if (not fused or what not in ("gate_up_proj", "down_proj") or len(shape) != 3
            or shape[0] != config.moe.num_experts):  # the loader could not split it either
        if mixtral and name.endswith(".mlp.gate.weight"):
            return (name.removesuffix("mlp.gate.weight") + "block_sparse_moe.gate.weight",)
        return (name,)
    at, (gate, up, down) = block(config, layer + "."), expert_projections(config)
    experts = [f"{at}experts.{e}." for e in range(shape[0])]
    if what == "down_proj":
        return tuple(f"{e}{down}.weight" for e in experts)
    return tuple(f"{e}{p}.weight" for e in experts for p in (gate, up))
