"""One pipeline stage's model runner (``--pipeline-parallel-size P``): rank r runs stage r.

Every rank runs each step rank 0 schedules (``core/ranks.py`` sends rank 0's calls to the
others), on the same batch: the same token positions, block tables and slots, so each
stage writes its own layers' KV into the same blocks of a pool the same size, and the
ledger, the scheduler and admission on rank 0 cover every stage. Within a step the
hidden states go stage to stage (``torch.distributed`` send and receive: gloo on the CPU,
NCCL on GPUs); the last stage computes the logits (and any prompt logprobs) and sends
them to rank 0, which samples. A step of many tokens runs in micro-batches, up to as many
as stages: a stage sends a part's hidden states on without waiting and starts the next
part while the next stage computes the first, so the stages overlap; a small step (a few
decodes) is one part.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from kvledger.engine.core.runner import ModelRunner, StepOutput
from kvledger.engine.core.scheduler import PrefillChunk, ScheduledBatch
from kvledger.engine.model.attention import AttentionMetadata
from kvledger.engine.model.pipeline import StageLM

# A part smaller than this costs more in messages than the overlap gains: on the CPU a
# 16 x 480-token prefill ran 1.23x faster in two parts (3404 against 2761 prompt tokens/s
# at pp 2), 8 decodes 0.6x as fast (bench/pp_throughput.py: 302-328 against 547-562 tok/s).
MIN_PART_TOKENS = 128


class StageRunner(ModelRunner):
    """A ``ModelRunner`` over one ``StageLM`` (or a tensor-parallel shard of it: rank
    ``tp_rank`` of the stage's ``tp``): it receives the previous stage's hidden states from
    the rank of its own ``tp_rank`` there, passes its own on to the next stage's, and the
    last stage's output reaches rank 0 (from the last stage's first rank). A stage's ranks
    hold the same hidden states after each layer's all-reduce, so each sends its own copy."""

    def __init__(self, model: StageLM, device: torch.device, max_model_len: int,
                 block_size: int, *, fuse: bool = True, tp_rank: int = 0, tp: int = 1,
                 paged: bool | None = None) -> None:
        super().__init__(model, device, max_model_len, block_size, fuse=fuse, paged=paged)
        self.stage = model.stage
        self.tp_rank, self.tp = tp_rank, tp
        self._sending: list[tuple[Any, torch.Tensor]] = []  # this step's sends not yet done
        self._overlap = False  # this step runs in parts: send without waiting

    def _rank(self, stage: int) -> int:
        """The global rank of this ``tp_rank`` in ``stage`` (ranks are stage-major)."""
        return stage * self.tp + self.tp_rank

    def _hidden(self, input_ids: list[int], positions: list[int], meta: AttentionMetadata,
                kv_cache: torch.Tensor | None) -> torch.Tensor:
        stage = self.stage
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)
        cos, sin = self.rope.lookup(pos)
        if stage.first:
            inputs = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        else:
            inputs = torch.empty(len(input_ids), self.config.hidden_size, dtype=self.dtype,
                                 device=self.device)
            dist.recv(inputs, src=self._rank(stage.index - 1))
        hidden = self.model(inputs, cos, sin, kv_cache, meta)
        if not stage.last:
            hidden, after = hidden.contiguous(), self._rank(stage.index + 1)
            if self._overlap:  # sent without waiting: this stage goes on to the next part
                self._sending.append((dist.isend(hidden, dst=after), hidden))
            else:
                dist.send(hidden, dst=after)
        return hidden

    @torch.inference_mode()
    def execute(self, batch: Any) -> StepOutput:
        """The step in micro-batches (``micro_batches``), one after another through this
        stage; rank 0 gets the step's output, put back in the batch's order, from the last
        stage; the other ranks give theirs (unused)."""
        stage = self.stage
        if stage.first and stage.last:
            return super().execute(batch)
        parts = micro_batches(batch, stage.count)
        self._sending, self._overlap = [], len(parts) > 1
        outputs = []
        for part in parts:
            output = super().execute(part)
            if stage.last and self.tp_rank == 0:
                dist.send_object_list([output], dst=0)
            outputs.append(output)
        if stage.first and self.tp_rank == 0:
            outputs = []
            for _ in parts:  # before waiting on the sends: the last stage may wait on these
                box: list[Any] = [None]
                dist.recv_object_list(box, src=(stage.count - 1) * self.tp)
                outputs.append(box[0])
        for work, _ in self._sending:
            work.wait()
        self._sending, self._overlap = [], False
        return merge_outputs(parts, outputs)


def micro_batches(batch: ScheduledBatch, count: int) -> list[ScheduledBatch]:
    """``batch`` cut into up to ``count`` parts of about equal tokens and at least
    ``MIN_PART_TOKENS`` each (a small step is one part), each a run of its
    prefill chunks and a run of its decodes (so the outputs concatenate back in order);
    the step's fresh blocks are zeroed with the first part, before any part writes. Every
    rank cuts a batch alike (the same batch, the same rule)."""
    tokens = sum(c.length for c in batch.prefills) + len(batch.decodes)
    count = max(1, min(count, len(batch.prefills) + len(batch.decodes),
                       tokens // MIN_PART_TOKENS))
    share = -(-tokens // count)
    parts: list[ScheduledBatch] = []
    current, size = ScheduledBatch([], [], list(batch.fresh_blocks)), 0
    for item in [*batch.prefills, *batch.decodes]:
        chunk = isinstance(item, PrefillChunk)
        (current.prefills if chunk else current.decodes).append(item)
        size += item.length if chunk else 1
        if size >= share and len(parts) < count - 1:
            parts.append(current)
            current, size = ScheduledBatch([], []), 0
    if current.prefills or current.decodes:
        parts.append(current)
    last = sum(c.length for c in parts[-1].prefills) + len(parts[-1].decodes)
    if len(parts) > 1 and last < MIN_PART_TOKENS:  # a small tail joins the part before it
        tail = parts.pop()
        parts[-1].prefills += tail.prefills
        parts[-1].decodes += tail.decodes
    return parts


def merge_outputs(parts: list[ScheduledBatch], outputs: list[StepOutput]) -> StepOutput:
    """One step's output from its parts': the completed prompts' rows of every part, then
    the decodes' (``ScheduledBatch.sampled``'s order)."""
    if len(outputs) == 1 or outputs[0].logits is None:
        return outputs[0]
    completed = [sum(c.completes_prompt for c in part.prefills) for part in parts]
    logits = torch.cat([o.logits[:n] for o, n in zip(outputs, completed, strict=True)]
                       + [o.logits[n:] for o, n in zip(outputs, completed, strict=True)])
    prompt_logprobs = {}
    for output in outputs:
        prompt_logprobs.update(output.prompt_logprobs)
    return StepOutput(logits, prompt_logprobs)
