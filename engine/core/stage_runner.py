"""One pipeline stage's model runner (``--pipeline-parallel-size P``): rank r runs stage r.

Every rank runs each step rank 0 schedules (``core/ranks.py`` sends rank 0's calls to the
others), on the same batch: the same token positions, block tables and slots, so each
stage writes its own layers' KV into the same blocks of a pool the same size, and the
ledger, the scheduler and admission on rank 0 cover every stage. Within a step the
hidden states go stage to stage (``torch.distributed`` send and receive: gloo on the CPU,
NCCL on GPUs); the last stage computes the logits (and any prompt logprobs) and sends
them to rank 0, which samples. The stages run one after another within a step (no
micro-batches yet).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from kvledger.engine.core.runner import ModelRunner, StepOutput
from kvledger.engine.model.pipeline import StageLM
from kvledger.engine.model.transformer import AttentionMetadata


class StageRunner(ModelRunner):
    """A ``ModelRunner`` over one ``StageLM`` (or a tensor-parallel shard of it: rank
    ``tp_rank`` of the stage's ``tp``): it receives the previous stage's hidden states from
    the rank of its own ``tp_rank`` there, passes its own on to the next stage's, and the
    last stage's output reaches rank 0 (from the last stage's first rank). A stage's ranks
    hold the same hidden states after each layer's all-reduce, so each sends its own copy."""

    def __init__(self, model: StageLM, device: torch.device, max_model_len: int,
                 block_size: int, *, fuse: bool = True, tp_rank: int = 0, tp: int = 1) -> None:
        super().__init__(model, device, max_model_len, block_size, fuse=fuse)
        self.stage = model.stage
        self.tp_rank, self.tp = tp_rank, tp

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
            dist.send(hidden.contiguous(), dst=self._rank(stage.index + 1))
        return hidden

    @torch.inference_mode()
    def execute(self, batch: Any) -> StepOutput:
        """Rank 0 gets the step's output from the last stage; the others give None."""
        output = super().execute(batch)
        stage = self.stage
        if stage.first and stage.last:
            return output
        if stage.last:
            if self.tp_rank == 0:
                dist.send_object_list([output], dst=0)
            return output
        if stage.first and self.tp_rank == 0:
            box: list[Any] = [None]
            dist.recv_object_list(box, src=(stage.count - 1) * self.tp)
            return box[0]
        return output
