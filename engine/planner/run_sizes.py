"""A declared run's sizes as the flags and the model resolve them: the context, the step's
token budget, and the KV pool's block and per-sequence need by layout and rule (the
engine's for an architecture it serves, vLLM's for a what-if)."""

from __future__ import annotations

from kvledger.engine.checkpoint.contents import ModelShape
from kvledger.engine.checkpoint.model_config import SUPPORTED_ARCHITECTURES
from kvledger.engine.errors import BadInput
from kvledger.engine.planner import estimates
from kvledger.engine.planner.pool import ENGINE_RULE, VLLM_RULE, KVGeometry, kv_geometry
from kvledger.engine.settings.config import EngineConfig
from kvledger.engine.settings.config_values import MIN_DEFAULT_BATCHED_TOKENS


def resolve_max_model_len(config: EngineConfig, shape: ModelShape) -> int:
    """``--max-model-len``, or the positions the model takes (``max_position_embeddings``,
    times a linear RoPE's factor; a longrope model's original_max_position_embeddings, as
    vLLM's default); never more than those."""
    if config.max_model_len is None:
        return shape.default_context or shape.max_position_embeddings
    if config.max_model_len > shape.max_position_embeddings:
        raise BadInput(f"--max-model-len {config.max_model_len} is more than the "
                       f"{shape.max_position_embeddings} positions the model takes (its "
                       f"max_position_embeddings, times a linear RoPE's factor)")
    return config.max_model_len


def resolve_max_num_batched_tokens(config: EngineConfig, max_model_len: int) -> int:
    """The flag, or ``max(max_model_len, 2048)`` (a whole prompt fits in one step)."""
    if config.max_num_batched_tokens is not None:
        return config.max_num_batched_tokens
    return max(max_model_len, MIN_DEFAULT_BATCHED_TOKENS)


def kv_rule(shape: ModelShape) -> str:
    """ENGINE_RULE for an architecture kvledger's engine serves (plan what it allocates),
    else VLLM_RULE (a what-if for a vLLM launch line)."""
    return ENGINE_RULE if shape.architecture in SUPPORTED_ARCHITECTURES else VLLM_RULE


def kv_layout_geometry(shape: ModelShape, config: EngineConfig, kv_dtype: str,
                       max_model_len: int, max_num_batched_tokens: int) -> KVGeometry:
    """The KV pool's block and what one sequence takes, by layout and rule (``kv_pool``)."""
    return kv_geometry(shape.kv_layout(), shape.architecture, kv_rule(shape), config.block_size,
                       estimates.DTYPE_BYTES[kv_dtype], max_model_len, max_num_batched_tokens)
