"""The estimated budget classes, each a formula written down here and in docs/planner.md.

The engine replaces these with what it measures (``Measured``) once it has loaded the
weights and run a profiling step; the planner in the init container has only these.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from kvledger.engine.checkpoint.contents import ModelShape

MiB = 2**20
GiB = 2**30

# Bytes per element of the dtype names the flags and config.json use.
DTYPE_BYTES = {
    "float32": 4, "float": 4, "fp32": 4,
    "float16": 2, "half": 2, "fp16": 2,
    "bfloat16": 2, "bf16": 2,
    "float64": 8,
    "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1,
}
# Canonical names for the aliases --dtype accepts.
CANONICAL_DTYPE = {"float": "float32", "fp32": "float32", "half": "float16", "fp16": "float16",
                   "bf16": "bfloat16", "fp8": "fp8_e4m3"}
# safetensors dtype -> the torch dtype name it loads as (for the model's dtype).
SAFETENSORS_FLOAT = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64"}

# Device context: the CUDA context, cuDNN's handles and the allocator's
# fragmentation reserve that torch.cuda does not report as tensors ("non-torch memory"
# in vLLM's profiler). 1 GiB is what a single-GPU vLLM process typically shows.
CUDA_CONTEXT_BYTES = 1 * GiB
# On the CPU: the interpreter, torch's and the tokenizer's runtime and the HTTP server.
CPU_CONTEXT_BYTES = 512 * MiB

# cuBLAS's workspace: torch gives each (handle, stream) one from its caching allocator at
# the first matmul and keeps it for the process's life. Its size is CUBLAS_WORKSPACE_CONFIG
# (":KiB:count" pairs, summed) when set, else torch's default: 32 MiB on Hopper and later
# (":4096:8"), 8.125 MiB before (":4096:2:16:8"). The planner does not know the GPU's
# generation before it starts, so it counts the larger; measured exactly 32 MiB on an H200
# (bench/gpu_checks.sh).
CUBLAS_DEFAULT_WORKSPACE_BYTES = 4096 * 1024 * 8

# Tensor parallelism's communication buffers, per rank (N > 1): NCCL's, for the
# all-reduce of every row-parallel layer. NCCL keeps NCCL_BUFFSIZE (4 MiB by default,
# NCCL's documented default; env NCCL_BUFFSIZE) per channel for each of its two ring
# neighbours, on up to 16 channels on an NVLink machine (NCCL_MAX_NCHANNELS can raise it),
# 4 MiB x 16 x 2 = 128 MiB. On the CPU gloo allocates its buffers per call from the
# tensors it sends (counted with the activations), nothing standing.
NCCL_BUFFSIZE_BYTES = 4 * MiB
NCCL_CHANNELS = 16
NCCL_BYTES_PER_RANK = NCCL_BUFFSIZE_BYTES * NCCL_CHANNELS * 2

# CUDA graphs: a shared memory pool plus per-graph, per-layer bookkeeping for each
# captured batch size (1, 2, 4, 8, then every 8 up to min(max_num_seqs, 512), as vLLM).
CUDA_GRAPH_POOL_BYTES = 256 * MiB
CUDA_GRAPH_PER_LAYER_PER_SIZE_BYTES = 128 * 1024
MAX_CAPTURE_BATCH = 512

# Safety margin kept free when no cap is given: discrete memory is the engine's alone,
# a unified pool is shared with the OS and every host process, so it keeps more.
MARGIN_FRACTION = 0.02
MARGIN_MIN_BYTES = 512 * MiB
UNIFIED_MARGIN_FRACTION = 0.10
UNIFIED_MARGIN_MIN_BYTES = 4 * GiB


def activation_peak_bytes(shape: ModelShape, dtype_bytes: int, max_num_batched_tokens: int,
                          max_num_seqs: int, context_tokens: int = 0,
                          kv_dtype_bytes: int | None = None,
                          gathered_sequences: int | None = None) -> int:
    """Peak activation memory of one engine step of ``T = max_num_batched_tokens`` tokens.

    Layers run one after another, so the peak is one layer's live tensors for all T tokens,
    the logits of the step, and the K/V attention gathers for one layer:

        T * max((4*hidden + qkv) * dtype_bytes + mlp, (2*hidden + 4*qkv + 2*head_dim) * dtype_bytes)
          + min(T, max_num_seqs) * vocab * 4 * 2
          + gathered_sequences * context_tokens * kv_heads * head_dim * 2 * gather_bytes
          + the step's masks (``mask_bytes``)

    ``qkv`` = (heads + 2*kv_heads) * head_dim. 4*hidden: residual, normed input, attention
    output, layer output; q, k and v; ``mlp`` the widest MLP a layer runs
    (``mlp_bytes_per_token``). Or, where the heads are wide beside the MLP (narrow experts,
    small models), attention's own peak: the layer's input and its norm, q, k and v, Qwen3's
    normed q and k, RoPE's products and rotated copy, the rows of cos and sin. Logits are
    float32 for the last token of each sequence, plus the probabilities the sampler
    computes from them. The engine's
    attention gathers the K and V of ``gathered_sequences`` (default ``max_num_seqs``: every
    decoding sequence on the CPU's path; 0 on a GPU's, whose kernels read the decodes and
    the later prompt chunks in place) of ``context_tokens`` (max_model_len rounded up to
    whole blocks) for one layer at a time, in the model dtype, plus the gathered copy in the
    KV dtype when that differs: ``gather_bytes`` = dtype_bytes (+ kv_dtype_bytes).
    """
    tokens = max_num_batched_tokens
    qkv = (shape.num_attention_heads + 2 * shape.num_kv_heads) * shape.head_dim
    per_token = max((4 * shape.hidden_size + qkv) * dtype_bytes
                    + mlp_bytes_per_token(shape, dtype_bytes),
                    (2 * shape.hidden_size + 4 * qkv + 2 * shape.head_dim) * dtype_bytes)
    logits_rows = min(tokens, max_num_seqs)
    gather_bytes = dtype_bytes
    if kv_dtype_bytes is not None and kv_dtype_bytes != dtype_bytes:
        gather_bytes += kv_dtype_bytes
    seqs = max_num_seqs if gathered_sequences is None else gathered_sequences
    gather = seqs * context_tokens * shape.num_kv_heads * shape.head_dim * 2 * gather_bytes
    masks = mask_bytes(shape, dtype_bytes, tokens, context_tokens, seqs)
    return tokens * per_token + logits_rows * shape.vocab_size * 4 * 2 + gather + masks


def mask_bytes(shape: ModelShape, dtype_bytes: int, tokens: int, context_tokens: int,
               gathered_sequences: int) -> int:
    """The masks a step of ``tokens`` tokens builds once and keeps through its layers
    (``core/step_attention.py``): where attention gathers (``gathered_sequences`` > 0), a
    later prompt chunk's causal mask over its context, one bool per query and key (at most
    ``tokens * context_tokens``, which also bounds a first chunk's), and each decoding
    sequence's additive mask over its context in the model dtype; elsewhere only a whole
    prompt longer than a sliding window has one, a bool square of its length (at most
    ``tokens * min(tokens, context_tokens)`` over the step's prompts)."""
    if gathered_sequences > 0:
        return tokens * context_tokens + gathered_sequences * context_tokens * dtype_bytes
    longest = min(tokens, context_tokens)
    windows = shape.kv_layout().sliding_windows
    return tokens * longest if windows and min(windows) < longest else 0


def mlp_bytes_per_token(shape: ModelShape, dtype_bytes: int) -> int:
    """What the widest MLP among the layers holds per token at its peak. A dense MLP: its
    gate, up and their product, ``3 * intermediate``. A routed layer (``shape.moe``; the
    engine's ``SparseMoE`` runs one expert at a time, and one expert may take every token):
    the float32 softmax over every expert (the router's logits are gone by then), the top-k
    weights, indices and sort order, then one expert's gate, up and product with its rows'
    input and output (then its output and the output weighted). A model whose every layer
    is routed never runs its dense width (Qwen3-MoE's ``intermediate_size``, which no
    tensor has then)."""
    moe = shape.moe
    dense_layers = shape.num_layers - (len(moe.sparse_layers) if moe is not None else 0)
    dense = 3 * shape.intermediate_size * dtype_bytes if dense_layers > 0 else 0
    if moe is None:
        return dense
    routing = moe.num_experts * 4 + moe.num_experts_per_tok * (4 + 3 * 8 + dtype_bytes)
    expert = (3 * moe.intermediate_size + 2 * shape.hidden_size) * dtype_bytes
    return max(dense, routing + expert)


def capture_sizes(max_num_seqs: int, sizes: tuple[int, ...] | None = None,
                  max_size: int | None = None) -> list[int]:
    """The decode batch sizes captured as CUDA graphs: ``sizes``
    (``--cudagraph-capture-sizes``) or vLLM's default list (1, 2, 4, then every 8) up to
    ``max_size`` (``--max-cudagraph-capture-size``, default 512); never above
    ``max_num_seqs``, the most decodes a step has. An empty list captures none."""
    limit = min(max_num_seqs, MAX_CAPTURE_BATCH if max_size is None else max_size)
    if sizes is not None:
        return sorted({s for s in sizes if s <= limit})
    chosen = [s for s in (1, 2, 4) if s <= limit]
    return chosen + list(range(8, limit + 1, 8))


def cuda_graph_bytes(shape: ModelShape, num_sizes: int) -> int:
    """``256 MiB + num_sizes * num_layers * 128 KiB``; 0 when no size is captured."""
    if num_sizes == 0:
        return 0
    return CUDA_GRAPH_POOL_BYTES + num_sizes * shape.num_layers * CUDA_GRAPH_PER_LAYER_PER_SIZE_BYTES


def context_bytes(device_kind: str) -> int:
    """Device context: 1 GiB on a GPU (what-if devices are GPUs), 512 MiB on the CPU."""
    return CPU_CONTEXT_BYTES if device_kind == "cpu" else CUDA_CONTEXT_BYTES


def matmul_workspace_bytes(device_kind: str, env: Mapping[str, str] | None = None) -> int:
    """cuBLAS's standing workspace on a GPU (see ``CUBLAS_DEFAULT_WORKSPACE_BYTES``), from
    CUBLAS_WORKSPACE_CONFIG when it is set and reads as ``:SIZE_KiB:COUNT`` pairs; 0 on the
    CPU."""
    if device_kind == "cpu":
        return 0
    config = (os.environ if env is None else env).get("CUBLAS_WORKSPACE_CONFIG", "")
    numbers = config.split(":")[1:]
    if config.startswith(":") and numbers and len(numbers) % 2 == 0 \
            and all(n.isdigit() for n in numbers):
        return sum(int(size) * 1024 * int(count)
                   for size, count in zip(numbers[::2], numbers[1::2], strict=True))
    return CUBLAS_DEFAULT_WORKSPACE_BYTES


def comm_buffer_bytes(device_kind: str, tensor_parallel_size: int) -> int:
    """One rank's standing communication buffers: ``NCCL_BYTES_PER_RANK`` on a GPU with
    N > 1, else 0."""
    return NCCL_BYTES_PER_RANK if tensor_parallel_size > 1 and device_kind != "cpu" else 0


def safety_margin_bytes(total_bytes: int, unified: bool) -> int:
    """Kept free when no cap is given: max(512 MiB, 2% of total); unified max(4 GiB, 10%)."""
    if unified:
        return max(UNIFIED_MARGIN_MIN_BYTES, int(total_bytes * UNIFIED_MARGIN_FRACTION))
    return max(MARGIN_MIN_BYTES, int(total_bytes * MARGIN_FRACTION))


def format_size(n: int) -> str:
    if 0 < abs(n) < MiB // 10:
        return f"{n / 1024:.1f} KiB"
    if 0 < abs(n) < GiB // 10:
        return f"{n / MiB:.1f} MiB"
    return f"{n / GiB:.1f} GiB"
