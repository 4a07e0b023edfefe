"""The bytes a checkpoint's weights take once the engine has loaded them, from the
safetensors headers alone: the one rule the plan counts and the engine's loader follows
(``model/loader.py``; tests hold the two equal). Which served format a checkpoint holds,
and what it keeps as stored, is ``checkpoint/weight_formats.py``'s to say.

- Floating tensors are cast to the model dtype.
- An FP8 checkpoint (``fp8_format``): its F8_E4M3 weights as stored, one byte each; its
  scales in float32, whatever dtype they are stored in; everything else (embeddings, LM
  head, norms, biases) cast to the model dtype.
- ``--quantization fp8``: each linear layer's weight at one byte plus a float32 scale per
  output channel (``fp8_format.on_load_bytes``); everything else cast to the model dtype.
- A layer's KV cache scales (``k_scale``, ``v_scale``): nothing, the loader reads them as
  numbers.
- A 4-bit checkpoint (``int4_format``: GPTQ, AWQ, compressed-tensors W4A16): each
  quantized layer's tensors exactly as stored (its format's ``kept_as_stored``) (codes, zeros, g_idx, scales in their own
  dtype); everything else (embeddings, LM head, norms, biases, unquantized layers) cast
  to the model dtype.
- A checkpoint quantized any other way (a vLLM what-if plan; the engine refuses it): as
  stored, its scales included.
"""

from __future__ import annotations

import threading
import weakref

from kvledger.engine.checkpoint.contents import (
    CASTABLE_DTYPES,
    DTYPE_BITS,
    ModelShape,
    WeightsInfo,
)
from kvledger.engine.checkpoint.fp8_format import (
    KV_SCALE_SUFFIXES,
    SCALE_BYTES,
    SCALE_SUFFIXES,
    on_load_bytes,
    quantized_on_load,
)
from kvledger.engine.checkpoint.weight_formats import run_format, stored_format
from kvledger.engine.planner import estimates
from kvledger.engine.planner.sharding import rank_share, shard_bytes

# Each checkpoint's answers, by its record's identity while it lives: a remedy search plans
# the same checkpoint a hundred times over, each time walking every tensor (a 70B at 4 GPUs:
# 1.4 s of the webhook's 2 refusals went there).
_ANSWERS: dict[int, tuple[weakref.ref, dict[tuple, int]]] = {}
_ANSWERS_LOCK = threading.Lock()


def loaded_weight_bytes(weights: WeightsInfo, model_dtype: str, *,
                        shape: ModelShape | None = None, quantize_fp8: bool = False,
                        tensor_parallel_size: int = 1) -> int:
    """The checkpoint's bytes as the engine holds them in ``model_dtype``; ``shape`` says
    how config.json quantizes them (None: not at all), ``quantize_fp8`` is
    ``--quantization fp8``. With ``tensor_parallel_size`` N > 1 (and ``shape``): what one
    rank holds, each tensor's share as ``sharding.rank_share`` says; a checkpoint known
    only by its totals (no tensor names) is counted as 1/N of them, rounded up.
    Remembered per ``weights`` record (records are not changed once read)."""
    key = (model_dtype, shape, quantize_fp8, tensor_parallel_size)
    with _ANSWERS_LOCK:
        kept = _ANSWERS.get(id(weights))
        if kept is not None and kept[0]() is weights and key in kept[1]:
            return kept[1][key]
    answer = _counted(weights, model_dtype, shape, quantize_fp8, tensor_parallel_size)
    with _ANSWERS_LOCK:
        kept = _ANSWERS.get(id(weights))
        if kept is None or kept[0]() is not weights:
            kept = (weakref.ref(weights, _forget), {})
            _ANSWERS[id(weights)] = kept
        kept[1][key] = answer
    return answer


def _forget(gone: weakref.ref) -> None:
    """A record's answers go with it (only its own: its id may be another's by now)."""
    for ident, (ref, _) in list(_ANSWERS.items()):
        if ref is gone:
            _ANSWERS.pop(ident, None)


def _counted(weights: WeightsInfo, model_dtype: str, shape: ModelShape | None,
             quantize_fp8: bool, tensor_parallel_size: int) -> int:
    tp = tensor_parallel_size if shape is not None else 1
    served = stored_format(shape, weights) if shape is not None else None
    as_stored = shape is not None and bool(shape.quantization) and served is None
    if as_stored and (tp == 1 or not weights.tensors):
        return -(-weights.total_bytes // tp)
    quantize_fp8 = quantize_fp8 and served is None  # the engine keeps a checkpoint's own
    target_bits = estimates.DTYPE_BYTES[model_dtype] * 8
    kv_scales = any(t.name.endswith(KV_SCALE_SUFFIXES) for t in weights.tensors)
    if not weights.tensors or (not (served or quantize_fp8 or kv_scales or as_stored)
                               and tp == 1):
        total = sum(n * target_bits // DTYPE_BITS[d] if d in CASTABLE_DTYPES else n
                    for d, n in weights.bytes_by_dtype.items())  # by dtype: every float cast
        return -(-(total if weights.bytes_by_dtype else weights.total_bytes) // tp)
    total = 0
    for t in weights.tensors:
        if t.name.endswith(KV_SCALE_SUFFIXES):
            continue  # read as numbers by the loader, not held as tensors
        if as_stored or (served is not None and served.kept_as_stored(t.name)):
            nbytes = t.nbytes
        elif t.name.endswith(SCALE_SUFFIXES):
            nbytes = SCALE_BYTES * (t.nbytes * 8 // DTYPE_BITS[t.dtype])
        elif t.dtype not in CASTABLE_DTYPES:
            nbytes = t.nbytes
        elif quantize_fp8 and quantized_on_load(t.name):
            nbytes = on_load_bytes(t.shape)
        else:
            nbytes = t.nbytes * target_bits // DTYPE_BITS[t.dtype]
        total += shard_bytes(nbytes, rank_share(t.name, t.shape, shape, tp)) if tp > 1 else nbytes
    return total


def dequantization_bytes(shape: ModelShape, weights: WeightsInfo, model_dtype: str, tokens: int,
                        *, quantize_fp8: bool) -> int:
    """What the run's quantized layers add to a step's activations (``weight_formats``:
    each format's ``workspace_bytes``, one layer dequantized at a time); 0 for weights
    that are not quantized."""
    served = run_format(shape, weights, quantize_fp8)
    if served is None:
        return 0
    return served.workspace_bytes(shape, weights, model_dtype,
                                  estimates.DTYPE_BYTES[model_dtype], tokens)
