"""Decode steps from static buffers, padded to a captured batch size, and on CUDA replayed
as CUDA graphs: a decode step of a 32-layer model launches hundreds of small kernels, and
at small batches their launch from Python, not the GPU's memory, sets the step's time.

A pure decode step of ``n`` sequences (no prompt chunk, no LoRA adapter) is padded to the
smallest captured size ``S >= n`` (vLLM's sizes: 1, 2, 4, then every 8 up to
``max_num_seqs``, at most 512; ``planner/estimates.capture_sizes``). Every input lives in a
buffer made once (token ids, positions, cache slots, and the paged kernel's rows); the
step copies its ``n`` rows in and pads the rest: a padding row reads nothing (its context
is empty) and writes its K and V into the pool's spare block, which no sequence is ever
given. The model's forward over the first ``S`` rows of those buffers is what CUDA
captures, once per size at start-up, into one shared memory pool; the LM head and the
sampler run after it, on the ``n`` real rows. A capture that fails, or a graph whose replay
differs from the same step run eagerly (``replay_check``), leaves the steps eager.

Only the paged attention path (``TRITON_ATTN``) can be captured: the gathered path's
shapes follow each step's contexts. A mixture of experts reads its routing back to the
host, so it runs eagerly. On the CPU the same buffers and padding run eagerly (nothing is
captured), which is how the tests hold padded steps to the tokens of unpadded ones.
"""

from __future__ import annotations

import logging
import time

import torch

from kvledger.engine.core.step_attention import padded_tables
from kvledger.engine.model.attention import AttentionMetadata, PagedRows
from kvledger.engine.planner.pool import blocks_for

log = logging.getLogger("kvledger.engine")


class DecodeGraphs:
    """The static buffers of the decode steps of up to ``max(sizes)`` sequences, and the
    graphs captured over them (none until ``capture``)."""

    def __init__(self, runner, sizes: list[int], pad_block: int) -> None:
        self.runner = runner
        self.sizes = sorted(set(sizes))
        self.max_size = self.sizes[-1]
        self.pad_slot = pad_block * runner.block_size
        width = blocks_for(runner.max_model_len, runner.block_size)
        device, rows = runner.device, self.max_size

        def zeros(*shape: int, dtype=torch.int32) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        self.input_ids = zeros(rows, dtype=torch.long)
        self.positions = zeros(rows, dtype=torch.long)
        self.slots = torch.full((rows,), self.pad_slot, dtype=torch.long, device=device)
        self.tables = zeros(rows, width)
        self.starts = zeros(rows)
        self.ends = zeros(rows)
        self.rows = torch.arange(rows, dtype=torch.long, device=device)
        self.table_rows = self.rows.to(torch.int32)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.captured_bytes = 0

    def size_for(self, n: int) -> int | None:
        """The smallest size ``>= n``; None above the largest."""
        return next((s for s in self.sizes if s >= n), None)

    def run(self, input_ids: list[int], positions: list[int], slots: list[int],
            tables: list[list[int]], contexts: list[int]) -> torch.Tensor:
        """The final hidden states ``[n, hidden]`` of ``n`` decoding sequences (their last
        token ids, positions, cache slots, block tables and contexts incl. this token)."""
        n = len(input_ids)
        size = self.size_for(n)
        device = self.runner.device

        def put(buffer: torch.Tensor, values: list, pad: int) -> None:
            filled = torch.tensor(values + [pad] * (size - n), dtype=buffer.dtype)
            buffer[:size].copy_(filled.to(device, non_blocking=True))

        put(self.input_ids, input_ids, 0)
        put(self.positions, positions, 0)
        put(self.slots, slots, self.pad_slot)
        put(self.ends, contexts, 0)
        put(self.starts, self.runner.attention.first_seen(contexts), 0)
        # Each real row's blocks; what lies past them (and the padding rows' tables) is
        # never read, as no row reads past its context.
        filled = padded_tables(tables)
        self.tables[:n, :filled.shape[1]].copy_(filled.to(device, non_blocking=True))
        captured = self.graphs.get(size)
        if captured is None:
            return self.forward(size)[:n]
        graph, hidden = captured
        graph.replay()
        return hidden[:n]

    def forward(self, size: int) -> torch.Tensor:
        """The model over the first ``size`` rows of the buffers: what a graph captures."""
        runner = self.runner
        meta = AttentionMetadata(
            slot_mapping=self.slots[:size], prefills=[], decode_groups=[],
            paged=PagedRows(tokens=self.rows[:size], block_tables=self.tables[:size],
                            table_rows=self.table_rows[:size], starts=self.starts[:size],
                            ends=self.ends[:size], max_positions=runner.max_model_len))
        cos, sin = runner.rope.lookup(self.positions[:size])
        return runner.model(self.input_ids[:size], cos, sin, runner.kv_cache, meta)

    def replay_check(self) -> str | None:
        """The smallest graph replayed against the same step run eagerly, one row reading
        the token it writes into the padding block: None when they agree, else by how much
        they differ. Start-up trusts no graph that this check has not passed."""
        size = self.sizes[0]
        pad_block = self.pad_slot // self.runner.block_size
        self.tables[0, 0], self.ends[0] = pad_block, 1  # row 0 sees position 0 of the pad block
        try:
            eager = self.forward(size).clone()
            graph, hidden = self.graphs[size]
            graph.replay()
            if self.runner.device.type == "cuda":
                torch.cuda.synchronize(self.runner.device)
            if not torch.allclose(hidden.float(), eager.float(), atol=1e-2, rtol=1e-2):
                return f"max difference {(hidden.float() - eager.float()).abs().max():.3g}"
            return None
        finally:
            self.tables[0, 0], self.ends[0] = 0, 0

    @torch.inference_mode()
    def capture(self) -> None:
        """Every size's graph, largest first, in one memory pool (the smaller sizes reuse
        the larger's blocks); the bytes taken and the time, logged."""
        device = self.runner.device
        torch.cuda.synchronize(device)
        before = torch.cuda.mem_get_info(device)[0]
        started = time.monotonic()
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(device)
        try:
            for size in reversed(self.sizes):
                stream.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(stream):
                    self.forward(size)  # compiles the kernels, settles the allocator
                torch.cuda.current_stream(device).wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    hidden = self.forward(size)
                self.graphs[size] = (graph, hidden)
        except Exception as exc:  # out of memory, a kernel that cannot be captured:
            # whatever it is, the engine still serves, eagerly, from the same buffers
            self.graphs.clear()
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()
            log.warning("CUDA graphs: capture failed (%s); decode steps run eagerly",
                        str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
            return
        failed = self.replay_check()
        if failed is not None:
            self.graphs.clear()
            log.warning("CUDA graphs: a replay differs from the eager step (%s); decode steps "
                        "run eagerly", failed)
            return
        torch.cuda.synchronize(device)
        self.captured_bytes = before - torch.cuda.mem_get_info(device)[0]
        log.info("CUDA graphs: %d decode sizes (1-%d) captured in %.1f s, %d bytes",
                 len(self.sizes), self.max_size, time.monotonic() - started,
                 self.captured_bytes)
