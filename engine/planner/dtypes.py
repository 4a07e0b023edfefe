"""The dtypes a plan runs in: the weights' (the model dtype) and the KV cache's.

``--dtype auto`` is the checkpoint's own dtype, as vLLM's is, except a float32 checkpoint on
a GPU: vLLM runs it in half precision (bfloat16 where the card computes in it, else
float16; its ``_resolve_auto_dtype``), and so do the plan and the engine, which loads the
weights in the plan's model dtype. On the CPU it stays float32. The plan's dtype is the one
the engine runs in, so this module is the one owner of the rule.
"""

from __future__ import annotations

from kvledger.engine.checkpoint.contents import ModelShape, WeightsInfo
from kvledger.engine.planner import estimates
from kvledger.engine.planner.device import DeviceMemory
from kvledger.engine.settings.config import EngineConfig

_FLOATS = ("float32", "float16", "bfloat16", "float64")


def checkpoint_dtype(shape: ModelShape, weights: WeightsInfo) -> str:
    """config.json's torch_dtype, else the float dtype holding the most bytes of weights
    (packed payloads, such as MXFP4's U8 blocks, are not it)."""
    name = estimates.CANONICAL_DTYPE.get(shape.torch_dtype, shape.torch_dtype)
    if name in _FLOATS:
        return name
    floats = {d: n for d, n in weights.bytes_by_dtype.items() if d in estimates.SAFETENSORS_FLOAT}
    if not floats:
        return estimates.SAFETENSORS_FLOAT.get(weights.dtype, "float32")
    return estimates.SAFETENSORS_FLOAT[max(floats, key=lambda d: floats[d])]


def resolve_model_dtype(config: EngineConfig, shape: ModelShape, weights: WeightsInfo,
                        device: DeviceMemory) -> str:
    """``--dtype``; ``auto`` = the checkpoint's dtype, a float32 one in half precision on a
    GPU (a what-if card is one)."""
    if config.dtype != "auto":
        return estimates.CANONICAL_DTYPE.get(config.dtype, config.dtype)
    stored = checkpoint_dtype(shape, weights)
    if stored == "float32" and device.kind != "cpu":
        return "bfloat16" if device.bfloat16 else "float16"
    return stored


def half_precision_note(config: EngineConfig, shape: ModelShape, weights: WeightsInfo,
                        model_dtype: str) -> str:
    """Why the model dtype is not the checkpoint's under ``--dtype auto``, for the report;
    "" when it is the checkpoint's."""
    stored = checkpoint_dtype(shape, weights)
    if config.dtype != "auto" or model_dtype == stored:
        return ""
    why = "this GPU does not compute in bfloat16" if model_dtype == "float16" else \
        "bfloat16 where the GPU computes in it"
    return (f"the {stored} checkpoint runs in {model_dtype} on a GPU, as vLLM's --dtype auto "
            f"runs it ({why}); --dtype {stored} keeps {stored}")


def resolve_kv_dtype(config: EngineConfig, model_dtype: str) -> str:
    """``--kv-cache-dtype``; ``auto`` = the model dtype; ``fp8`` = fp8_e4m3."""
    if config.kv_cache_dtype == "auto":
        return model_dtype
    return estimates.CANONICAL_DTYPE.get(config.kv_cache_dtype, config.kv_cache_dtype)
