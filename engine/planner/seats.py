"""How many sequences run at once (``max_num_seqs``, the scheduler's seats) when the user
declared none.

- Under a cap (``--gpu-memory-utilization``, ``--memory-limit``) that sizes the KV pool
  (pool mode ``"cap"``), vLLM's semantics: the pool takes all that is left under the cap,
  and the seats are the whole ``max_model_len`` sequences it holds, planned with the
  activations and CUDA graphs of that many seats (both grow with them), at most
  ``seat_bound`` (vllm serve's default ``max_num_seqs`` for the device, never more than
  ``max_num_batched_tokens``, as vLLM bounds it: a step decodes one token of each). The least
  is one: a pool that cannot hold one full-context sequence is refused, as vLLM refuses it.
- Else (no cap, or a pool sized by ``--num-gpu-blocks-override`` /
  ``--kv-cache-memory-bytes``): ``DEFAULT_MAX_NUM_SEQS``.
"""

from __future__ import annotations

from collections.abc import Callable

from kvledger.engine.planner.device import DeviceMemory
from kvledger.engine.planner.estimates import GiB
from kvledger.engine.planner.remedies import largest_fitting

# Where the plan's max_num_seqs came from (the plan JSON's "max_num_seqs_source").
DECLARED = "--max-num-seqs"
DEFAULT = "default"
KV_POOL = "kv-pool"

# vllm serve's default max_num_seqs (vllm/engine/arg_utils.py, get_batch_defaults).
VLLM_SERVE_SEATS = 256
VLLM_SERVE_SEATS_LARGE_GPU = 1024  # 70 GiB or more, other than an A100
VLLM_SERVE_SEATS_CPU = 128
LARGE_GPU_BYTES = 70 * GiB


def seat_bound(device: DeviceMemory, max_num_batched_tokens: int,
               profiled_seats: int | None = None) -> tuple[int, str]:
    """The most seats a derived ``max_num_seqs`` may have on ``device``, and why: vllm
    serve's default, never more than ``max_num_batched_tokens``, nor than the seats the
    engine profiled its activations at (``profiled_seats``: a measured peak holds for no
    more)."""
    if device.kind == "cpu":
        bound, why = VLLM_SERVE_SEATS_CPU, "vllm serve's default on a CPU"
    elif device.total_bytes >= LARGE_GPU_BYTES and "a100" not in device.name.lower():
        bound, why = VLLM_SERVE_SEATS_LARGE_GPU, "vllm serve's default on a GPU of 70 GiB or more"
    else:
        bound, why = VLLM_SERVE_SEATS, "vllm serve's default"
    if max_num_batched_tokens < bound:
        bound, why = max_num_batched_tokens, "max_num_batched_tokens"
    if profiled_seats is not None and profiled_seats < bound:
        bound, why = profiled_seats, "the seats the engine profiled"
    return bound, f"at most {bound}, {why}"


def derive_seats(fits_with: Callable[[int], bool], bound: int) -> int:
    """The most seats in [1, ``bound``] whose plan fits (``fits_with(n)``: the pool left
    under the cap with n seats' activations holds n sequences, monotone in n); 1 when
    none does, whose plan is then the refusal."""
    return largest_fitting(fits_with, 1, max(1, bound)) or 1
