"""The bytes a checkpoint's weights take once the engine has loaded them, from the
safetensors headers alone: the one rule the plan counts and the engine's loader follows
(``model/loader.py``; tests hold the two equal).

- Floating tensors are cast to the model dtype.
- An FP8 checkpoint (``fp8_format``): its F8_E4M3 weights as stored, one byte each; its
  scales in float32, whatever dtype they are stored in; everything else (embeddings, LM
  head, norms, biases) cast to the model dtype.
- ``--quantization fp8``: each linear layer's weight at one byte plus a float32 scale per
  output channel (``fp8_format.on_load_bytes``); everything else cast to the model dtype.
- A layer's KV cache scales (``k_scale``, ``v_scale``): nothing, the loader reads them as
  numbers.
- A 4-bit checkpoint (``int4_format``: GPTQ, AWQ, compressed-tensors W4A16): each
  quantized layer's tensors exactly as stored (codes, zeros, g_idx, scales in their own
  dtype); everything else (embeddings, LM head, norms, biases, unquantized layers) cast
  to the model dtype.
- A checkpoint quantized any other way (a vLLM what-if plan; the engine refuses it): as
  stored, its scales included.
"""

from __future__ import annotations

from kvledger.engine.checkpoint.contents import (
    CASTABLE_DTYPES,
    DTYPE_BITS,
    ModelShape,
    WeightsInfo,
)
from kvledger.engine.checkpoint.fp8_format import (
    FP8,
    FP8_DTYPE,
    KV_SCALE_SUFFIXES,
    SCALE_BYTES,
    SCALE_SUFFIXES,
    on_load_bytes,
    quantized_on_load,
)
from kvledger.engine.checkpoint.int4_format import AWQ, GPTQ, W4A16, layer_tensor
from kvledger.engine.checkpoint.model_config import SUPPORTED_ARCHITECTURES
from kvledger.engine.planner import estimates
from kvledger.engine.planner.sharding import rank_share, shard_bytes


def stored_fp8(shape: ModelShape, weights: WeightsInfo) -> bool:
    """Whether the checkpoint is FP8 that kvledger's engine serves, for an architecture it
    serves: quant_method ``fp8``, or ``compressed-tensors`` holding F8_E4M3 tensors (its
    float-quantized format; ``fp8_format.fp8_method`` checks config.json). Another
    architecture's FP8 (DeepSeek-V3's block-wise scales) is a vLLM what-if, as stored."""
    if shape.architecture not in SUPPORTED_ARCHITECTURES:
        return False
    return shape.quantization == FP8 or (shape.quantization == "compressed-tensors"
                                         and FP8_DTYPE in weights.bytes_by_dtype)


def stored_int4(shape: ModelShape, weights: WeightsInfo) -> str:
    """The 4-bit method (``int4_format``'s name) of a checkpoint kvledger's engine serves
    so, "" for none: quant_method ``gptq`` or ``awq``, or ``compressed-tensors`` holding
    ``weight_packed`` tensors (its pack-quantized format; config.json is checked by
    ``int4_format.int4_method``)."""
    if shape.architecture not in SUPPORTED_ARCHITECTURES:
        return ""
    if shape.quantization in (GPTQ, AWQ):
        return shape.quantization
    packed = any(t.name.endswith(".weight_packed") for t in weights.tensors)
    return W4A16 if shape.quantization == "compressed-tensors" and packed else ""


def loaded_weight_bytes(weights: WeightsInfo, model_dtype: str, *,
                        shape: ModelShape | None = None, quantize_fp8: bool = False,
                        tensor_parallel_size: int = 1) -> int:
    """The checkpoint's bytes as the engine holds them in ``model_dtype``; ``shape`` says
    how config.json quantizes them (None: not at all), ``quantize_fp8`` is
    ``--quantization fp8``. With ``tensor_parallel_size`` N > 1 (and ``shape``): what one
    rank holds, each tensor's share as ``sharding.rank_share`` says; a checkpoint known
    only by its totals (no tensor names) is counted as 1/N of them, rounded up."""
    tp = tensor_parallel_size if shape is not None else 1
    fp8 = shape is not None and stored_fp8(shape, weights)
    int4 = stored_int4(shape, weights) if shape is not None else ""
    as_stored = shape is not None and bool(shape.quantization) and not (fp8 or int4)
    if as_stored and (tp == 1 or not weights.tensors):
        return -(-weights.total_bytes // tp)
    quantize_fp8 = quantize_fp8 and not (fp8 or int4)  # the engine keeps a checkpoint's own
    target_bits = estimates.DTYPE_BYTES[model_dtype] * 8
    kv_scales = any(t.name.endswith(KV_SCALE_SUFFIXES) for t in weights.tensors)
    if not weights.tensors or (not (fp8 or int4 or quantize_fp8 or kv_scales or as_stored)
                               and tp == 1):
        total = sum(n * target_bits // DTYPE_BITS[d] if d in CASTABLE_DTYPES else n
                    for d, n in weights.bytes_by_dtype.items())  # by dtype: every float cast
        return -(-(total if weights.bytes_by_dtype else weights.total_bytes) // tp)
    total = 0
    for t in weights.tensors:
        if t.name.endswith(KV_SCALE_SUFFIXES):
            continue  # read as numbers by the loader, not held as tensors
        if as_stored or (int4 and layer_tensor(t.name, int4)):
            nbytes = t.nbytes
        elif t.name.endswith(SCALE_SUFFIXES):
            nbytes = SCALE_BYTES * (t.nbytes * 8 // DTYPE_BITS[t.dtype])
        elif t.dtype not in CASTABLE_DTYPES:
            nbytes = t.nbytes
        elif quantize_fp8 and not fp8 and quantized_on_load(t.name):
            nbytes = on_load_bytes(t.shape)
        else:
            nbytes = t.nbytes * target_bits // DTYPE_BITS[t.dtype]
        total += shard_bytes(nbytes, rank_share(t.name, t.shape, shape, tp)) if tp > 1 else nbytes
    return total


def fp8_workspace_bytes(shape: ModelShape, weights: WeightsInfo, model_dtype: str, tokens: int,
                        *, quantize_fp8: bool) -> int:
    """What FP8 layers add to a step's activations (``fp8_linear.Fp8Linear``): the largest
    linear layer's weight dequantized (``fp8_linear.dequantize``: its float16 bits, then
    the model dtype's copy unless that is float16; one layer at a time, freed after its
    matmul), and with static input scales the widest input rounded through float32 and FP8
    (``tokens`` rows). 0 for weights that are not FP8."""
    if not ((quantize_fp8 and not shape.quantization) or stored_fp8(shape, weights)):
        return 0
    q_size = shape.num_attention_heads * shape.head_dim
    widest_in = max(shape.hidden_size, q_size, shape.intermediate_size)
    largest = max(shape.intermediate_size, q_size) * shape.hidden_size
    static = any(t.name.endswith(".input_scale") for t in weights.tensors)
    rounding = tokens * widest_in * (4 + 1 + estimates.DTYPE_BYTES[model_dtype]) if static else 0
    dequantized = 2 if model_dtype == "float16" else 2 + estimates.DTYPE_BYTES[model_dtype]
    return largest * dequantized + rounding


def int4_workspace_bytes(shape: ModelShape, weights: WeightsInfo) -> int:
    """What 4-bit layers add to a step's activations (``int4_linear.Int4Linear``, which
    dequantizes per call): the largest linear layer's weight at 8 bytes a weight, the most
    its dequantization holds at once in any model dtype up to float32 (its codes unpacked
    to int32 and reordered (AWQ), or the codes and the weight in the model dtype, or that
    weight and a zero or scale gathered per input). One layer at a time, freed after its
    matmul. 0 for weights that are not 4-bit."""
    if not stored_int4(shape, weights):
        return 0
    q_size = shape.num_attention_heads * shape.head_dim
    return max(shape.intermediate_size, q_size) * shape.hidden_size * 8
