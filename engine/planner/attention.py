"""Which attention path a run takes (``--attention-backend``), and so whether attention
copies each sequence's K and V out of the block pool, a copy the plan must set aside as
activation memory.

- ``TRITON_ATTN`` (a GPU's default, vLLM's name for its Triton backend): Triton kernels
  read the blocks in place, the decodes' (``model/paged_attention.py``) and a later prompt
  chunk's (``model/prefill_attention.py``); nothing is copied.
- ``TORCH_SDPA`` (the CPU's default; ``CPU_ATTN``, vLLM's CPU backend, names it too): the
  blocks of each sequence are gathered into one tensor per layer and handed to torch's
  SDPA, faster on the CPU, where Triton has no backend.
"""

from __future__ import annotations

TRITON_ATTN = "TRITON_ATTN"
TORCH_SDPA = "TORCH_SDPA"


def attention_backend(requested: str, device_kind: str) -> str:
    """``TRITON_ATTN`` or ``TORCH_SDPA`` for ``--attention-backend`` on a device of
    ``device_kind`` (``cpu``, ``cuda``, ``meta`` or a what-if card)."""
    if requested == "auto":
        return TORCH_SDPA if device_kind in ("cpu", "meta") else TRITON_ATTN
    return TORCH_SDPA if requested == "CPU_ATTN" else requested


def gathers_kv(backend: str) -> bool:
    """Whether attention copies K and V out of the pool (the plan counts it)."""
    return backend == TORCH_SDPA
