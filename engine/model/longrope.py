"""LongRoPE (Phi-3-mini-128k, Phi-3.5-mini, Phi-4-mini): RoPE's frequencies each divided by
a per-pair factor, and cos and sin times an attention factor (``checkpoint/phi3_config.py``
reads them).

Which factors: the long ones when the run's context (``--max-model-len``) reaches past
``original_max_position_embeddings``, else the short ones, for every token of the run, as
vLLM 0.32 chooses them. transformers chooses per forward call, by the sequence's length so
far, so a sequence that grows past the original length there has its earlier keys cached
with the short factors and its later ones with the long: one choice per run keeps every
cached block (and every prefix-cache hit) turned by the factors the query uses. The two
agree whenever a prompt and what follows stay on one side (docs/coming-from-vllm.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch


def uses_long_factors(scaling: Mapping[str, Any], max_positions: int) -> bool:
    """Whether a run of ``max_positions`` positions turns by ``long_factor``."""
    return max_positions > scaling["original_max_position_embeddings"]


def longrope_frequencies(dim: int, theta: float, scaling: Mapping[str, Any],
                         max_positions: int) -> tuple[torch.Tensor, float]:
    """(inverse frequencies ``[dim / 2]``, the factor cos and sin are multiplied by), as
    transformers' ``_compute_longrope_parameters`` computes them."""
    key = "long_factor" if uses_long_factors(scaling, max_positions) else "short_factor"
    factors = torch.tensor(scaling[key], dtype=torch.float32)
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (factors * theta ** exponents), float(scaling["attention_factor"])
