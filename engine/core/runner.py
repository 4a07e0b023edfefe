"""Turns a scheduled batch into tensors, runs the model, returns one logits row per
sequence (and the prompt logprobs of the chunks that asked). Owns the paged KV cache:
one tensor of ``[num_layers, 2, num_kv_heads, num_blocks, block_size, head_dim]``."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvledger.engine.core import profile_steps
from kvledger.engine.core.decode_graphs import DecodeGraphs
from kvledger.engine.core.scheduler import ScheduledBatch
from kvledger.engine.core.sequence import Sequence
from kvledger.engine.core.step_attention import StepAttention
from kvledger.engine.errors import BadInput
from kvledger.engine.model import paged_attention, prefill_attention
from kvledger.engine.model.attention import AttentionMetadata
from kvledger.engine.model.cpu_linear import pack_linears
from kvledger.engine.model.fusion import fuse_projections
from kvledger.engine.model.gemma import sliding_layers_window
from kvledger.engine.model.loader import Weights
from kvledger.engine.model.lora import LoraSlots
from kvledger.engine.model.moe import SparseMoE
from kvledger.engine.model.transformer import CausalLM, RotaryEmbedding
from kvledger.engine.planner.attention import TRITON_ATTN, attention_backend
from kvledger.engine.planner.ready_time import TimeToReady
from kvledger.engine.sampling.logprobs import TokenLogprobs, logprobs_of
from kvledger.engine.sampling.params import MAX_LOGPROBS

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
                "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
                "fp8_e5m2": torch.float8_e5m2}

# Prompt logprobs are computed this many positions at a time, so a 2048-token chunk never
# holds a [2048, vocab] float32 logits tensor (and its log_softmax) at once.
PROMPT_LOGPROBS_ROWS = 256


@dataclass
class StepOutput:
    # float32 [len(batch.sampled), vocab], in ``batch.sampled``'s order; None from a
    # pipeline stage before the last (the last stage's reaches rank 0)
    logits: torch.Tensor | None
    # By request id, for the prefill chunks whose request asked: one entry per prompt token
    # this chunk predicts (the next one of each of its positions), None first for the
    # prompt's first token. Empty when no chunk asked.
    prompt_logprobs: dict[str, list[TokenLogprobs | None]]


class ModelRunner:
    def __init__(self, model: CausalLM, device: torch.device, max_model_len: int,
                 block_size: int, *, fuse: bool = True, paged: bool | None = None) -> None:
        """``fuse``: q/k/v and gate/up as one layer each (fusion.py); False for an engine
        that will ``enable_lora``, whose adapters add to each projection. ``paged``:
        decodes and later prompt chunks read the KV pool in place (paged_attention.py,
        prefill_attention.py; ``--attention-backend TRITON_ATTN``) rather than gathered for
        SDPA; None: on CUDA."""
        self.model = model
        self.config = model.config
        self.device = device
        # The model dtype (a norm's: an FP8 checkpoint's linear weights are not in it); a
        # pipeline stage before the last has no LM head (model/pipeline.py).
        self.dtype = model.model.layers[0].input_layernorm.weight.dtype
        self.has_head = hasattr(model, "lm_head")
        self.fused = fuse  # how the model's layers were arranged: a reloaded one must match
        if fuse:
            fuse_projections(model)
        # On the CPU: oneDNN's packed weights (cpu_linear.py).
        self.packed = pack_linears(model, device) > 0
        self.block_size = block_size
        self.max_model_len = max_model_len
        if paged is None:  # the device's default path (planner/attention.py)
            paged = attention_backend("auto", device.type) == TRITON_ATTN
        self.paged = paged
        if self.paged:
            paged_attention.require(device)
        if self.paged and device.type == "cuda":
            failed = (paged_attention.self_check(device, self.dtype)
                      or prefill_attention.self_check(device, self.dtype))
            if failed is not None:
                raise BadInput(f"the paged attention kernels do not run on this GPU "
                               f"({failed}); --attention-backend TORCH_SDPA gathers the "
                               "blocks for SDPA instead (planned with that copy)")
        self.attention = StepAttention(block_size, max_model_len, self.config.sliding_window,
                                       self.dtype, device, self.paged,
                                       sliding_layers_window(self.config))
        self.rope = RotaryEmbedding(self.config, max_model_len, device, self.dtype)
        self.kv_cache: torch.Tensor | None = None
        self.lora: LoraSlots | None = None  # with --enable-lora: the adapter slots
        self.decode_graphs: DecodeGraphs | None = None  # use_decode_graphs
        self.weights: Weights | None = None  # where they were read: read again after sleep
        self.time_to_ready: TimeToReady | None = None  # what its start took (startup.py)
        self.prompt_logits = False  # prompt logprobs report logits (--logprobs-mode *_logits)

    def enable_lora(self, max_loras: int, max_lora_rank: int) -> int:
        """Preallocate the adapter slots (after the packed base layers); returns their bytes."""
        self.lora = LoraSlots(self.model, max_loras, max_lora_rank, self.dtype, self.device)
        return self.lora.bytes

    def allocate_kv_cache(self, num_blocks: int, kv_dtype: str) -> int:
        """Allocate the whole pool up front; returns its bytes."""
        self.kv_cache = self._new_kv_cache(num_blocks, kv_dtype)
        return self.kv_cache.numel() * self.kv_cache.element_size()

    def can_use_decode_graphs(self) -> bool:
        """Whether decode steps can run from static buffers (decode_graphs.py): on the paged
        path, one process with the LM head, no adapters, no experts (their routing is read
        back to the host), no sliding layers among full ones (Gemma 3's read metadata of
        their own, which the graphs' buffers do not hold)."""
        return (self.paged and self.has_head and self.lora is None
                and self.attention.layer_window is None
                and not any(isinstance(m, SparseMoE) for m in self.model.modules()))

    def use_decode_graphs(self, sizes: list[int], *, capture: bool) -> None:
        """Pure decode steps of up to ``max(sizes)`` sequences from static buffers, padded
        to ``sizes`` and, with ``capture`` (CUDA), replayed as graphs. The pool's last
        block becomes the padding's (the ledger is given one block fewer than the pool)."""
        self.decode_graphs = DecodeGraphs(self, sizes, pad_block=self.kv_cache.shape[3] - 1)
        if capture:
            self.decode_graphs.capture()

    def _new_kv_cache(self, num_blocks: int, kv_dtype: str | None) -> torch.Tensor:
        dtype = self.dtype if kv_dtype in ("auto", None) else TORCH_DTYPES[kv_dtype]
        c = self.config  # a pipeline stage keeps its own layers' KV
        return torch.zeros(len(self.model.model.layers), 2, c.num_kv_heads, num_blocks,
                           self.block_size, c.head_dim, dtype=dtype, device=self.device)

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> StepOutput:
        """The logits of the last token of each prompt completed this step, then of each
        decoding sequence; and the prompt logprobs of the chunks whose request asked,
        from the same forward pass (they add no KV: only more logits rows)."""
        input_ids, positions, slots, last_index = [], [], [], []
        scored = []  # (sequence, its chunk's first row, first position, last position + 1)
        for chunk in batch.prefills:
            seq, start, end = chunk.seq, chunk.start, chunk.start + chunk.length
            if seq.prompt_logprobs is not None:
                # A position is scored when the token after it is a prompt token.
                scored.append((seq, len(input_ids), start, min(end, seq.num_prompt_tokens - 1)))
            input_ids += seq.prompt_token_ids[start:end]
            positions += range(start, end)
            slots += self._slots(seq.block_ids, start, end)
            if chunk.completes_prompt:
                last_index.append(len(input_ids) - 1)
        for seq in batch.decodes:
            position = seq.num_tokens - 1
            input_ids.append(seq.last_token_id)
            positions.append(position)
            slots += self._slots(seq.block_ids, position, position + 1)
            last_index.append(len(input_ids) - 1)
        if batch.fresh_blocks:  # new to their owner: nothing of a last owner's stays
            blocks = torch.tensor(batch.fresh_blocks, dtype=torch.long, device=self.device)
            self.kv_cache.view(torch.uint8).index_fill_(3, blocks, 0)
        graphs = self.decode_graphs
        if graphs is not None and not batch.prefills and graphs.size_for(len(batch.decodes)):
            hidden = graphs.run(input_ids, positions, slots,
                                [s.block_ids for s in batch.decodes],
                                [s.num_tokens for s in batch.decodes])
            return StepOutput(self._logits(hidden, last_index), {})
        meta = self._metadata(batch, slots)
        if self.lora is not None:
            meta.lora = self.lora.batch([(c.seq.lora, c.length) for c in batch.prefills]
                                        + [(s.lora, 1) for s in batch.decodes])
        hidden = self._hidden(input_ids, positions, meta, self.kv_cache)
        if not self.has_head:  # a pipeline stage before the last: the next one goes on
            return StepOutput(None, {})
        logits = self._logits(hidden, last_index)
        prompt_logprobs = {seq.request_id: self._prompt_logprobs(hidden[row:row + stop - start],
                                                                 seq, start)
                           for seq, row, start, stop in scored}
        return StepOutput(logits, prompt_logprobs)

    def _prompt_logprobs(self, hidden: torch.Tensor, seq: Sequence,
                         start: int) -> list[TokenLogprobs | None]:
        """Logprobs of the prompt tokens that ``hidden`` (positions ``start``, ``start +
        1``...) predicts, ``PROMPT_LOGPROBS_ROWS`` positions at a time, each slice reduced
        to ``TokenLogprobs`` before the next one's logits exist."""
        entries: list[TokenLogprobs | None] = [None] if start == 0 else []
        k = seq.params.prompt_logprobs
        for first in range(0, hidden.shape[0], PROMPT_LOGPROBS_ROWS):
            rows = hidden[first:first + PROMPT_LOGPROBS_ROWS]
            begin = start + first + 1  # the first token these rows predict
            targets = torch.tensor(seq.prompt_token_ids[begin:begin + rows.shape[0]],
                                   dtype=torch.long, device=self.device)
            entries += logprobs_of(self.model.logits(rows), targets, [k] * rows.shape[0],
                                   self.prompt_logits)()
        return entries

    @torch.inference_mode()
    def profile(self, num_tokens: int, max_model_len: int, max_num_seqs: int,
                kv_dtype: str = "auto", *, full_steps: bool | None = None) -> int | None:
        """The peak activation bytes of the heaviest engine steps, on CUDA; None elsewhere
        (the CPU keeps no allocator statistics).

        Two steps of ``num_tokens`` tokens are measured, the peak of both returned:

        - prefill: whole prompts, no cache (the MLP and logits peak), then one slice of
          prompt logprobs (``PROMPT_LOGPROBS_ROWS`` rows of logits, log_softmax, top k);
        - mixed: ``min(max_num_seqs, num_tokens) - 1`` decodes at the full context plus
          the rest of the budget as the last chunk of a prompt, which attends to its
          cached context (whole prompts for what one chunk cannot take): on TORCH_SDPA
          what attention gathers per layer (K and V of every sequence, in the KV dtype
          and the model dtype) and the chunk's attention scores, on TRITON_ATTN the decode
          kernel's partial outputs (nothing gathered). A pure decode step takes no more.

        The mixed step reads a one-block scratch cache through block tables that repeat
        block 0: the gathered tensors have their real size, the pool is not needed
        (``profile_steps.py`` builds both). On the CPU nothing is measured: one prompt of
        ``CPU_CHECK_TOKENS`` tokens at the top of the context checks that the model runs
        (every layer, the logits, a slice of prompt logprobs), in milliseconds where the
        full prefill took most of a start (9 of 14 s for a 1.4 GB checkpoint).
        ``full_steps`` True runs the two full steps there too (a test counts their
        tensors against the plan).
        """
        cuda = self.device.type == "cuda"
        scratch = None
        # Each step is built as it runs: the engine never holds two steps' masks at once.
        if self.device.type == "cpu" if full_steps is None else not full_steps:
            steps = (profile_steps.check_step(self.attention, max_model_len),)
        else:
            steps = (build() for build in (
                lambda: profile_steps.prefill_step(self.attention, num_tokens, max_model_len),
                lambda: profile_steps.mixed_step(self.attention, num_tokens, max_model_len,
                                                 max_num_seqs)))
            scratch = self._new_kv_cache(1, kv_dtype)
        if cuda:
            torch.cuda.synchronize(self.device)
            # cuBLAS's workspace (32 MiB on Hopper) is taken at the first matmul and kept:
            # freed here, it is taken again inside the measured steps and counted with
            # them, whatever ran a matmul before (the planner counts it there too).
            torch._C._cuda_clearCublasWorkspaces()
            torch.cuda.reset_peak_memory_stats(self.device)
            before = torch.cuda.memory_allocated(self.device)
        for input_ids, positions, meta, last_index in steps:
            # The prefill step has no cache (slot_mapping None); the mixed one the scratch.
            cache = None if meta.slot_mapping is None else scratch
            hidden = self._hidden(input_ids, positions, meta, cache)
            logits = self._logits(hidden, last_index) if self.has_head else None
            if cache is None and self.has_head:  # and a slice of prompt logprobs at its widest
                rows = hidden[:PROMPT_LOGPROBS_ROWS]
                targets = torch.zeros(rows.shape[0], dtype=torch.long, device=self.device)
                # Queued only: the memory is what is measured; no copy back (meta has none).
                logprobs_of(self.model.logits(rows), targets, [MAX_LOGPROBS] * rows.shape[0])
                del rows  # a view: it would keep this step's hidden states through the next
            del hidden, logits
        if not cuda:
            return None
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - before
        del scratch
        # Hand the step's cached blocks back to the device: the pool is allocated next
        # and the context is measured as device memory the allocator does not hold.
        torch.cuda.empty_cache()
        return peak

    def _hidden(self, input_ids: list[int], positions: list[int], meta: AttentionMetadata,
                kv_cache: torch.Tensor | None) -> torch.Tensor:
        """The final hidden state of every token ``[len(input_ids), hidden_size]``."""
        ids = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)
        cos, sin = self.rope.lookup(pos)
        return self.model(ids, cos, sin, kv_cache, meta)

    def _logits(self, hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
        index = torch.tensor(rows, dtype=torch.long, device=self.device)
        return self.model.logits(hidden[index])

    def _slots(self, block_ids: list[int], start: int, end: int) -> list[int]:
        bs = self.block_size
        return [block_ids[p // bs] * bs + p % bs for p in range(start, end)]

    def _metadata(self, batch: ScheduledBatch, slots: list[int]) -> AttentionMetadata:
        return self.attention.metadata(
            [(c.seq.block_ids, c.start, c.length) for c in batch.prefills],
            [(s.block_ids, s.num_tokens) for s in batch.decodes],
            torch.tensor(slots, dtype=torch.long, device=self.device))
