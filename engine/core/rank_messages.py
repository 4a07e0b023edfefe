"""What crosses between rank 0 and the other ranks (a pipe on one machine, the sealed
channel between machines): typed messages (msgspec Structs, tagged by class), sent as
msgpack by ``core/wire.py``, which builds nothing but ``Message``'s types on the way in,
each field checked against its annotation. No pickle: a message is data, never code.

- ``Hello``: a rank of another machine joining (its rank, its model's fingerprint, its
  machine's device); machine 0 answers ``Start`` (its ``RankSpec``) or ``Refused``.
- ``Ready``: a rank has built its shard. ``Alive``: a pulse, both ways.
- the calls rank 0 makes on its model runner, which every rank runs on the same inputs:
  ``Profile``, ``AllocateKvCache``, ``Execute``, ``Measure`` (answered with
  ``RankFigures``) and ``Stop``.

``StepView`` is what ``execute`` reads of a scheduled batch, as plain values: the batch
itself holds reservations, grammars and generators that stay in rank 0.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from msgspec import Struct

from kvledger.engine.checkpoint.read_ahead import AS_VLLM_DEFAULTS, WeightReading
from kvledger.engine.core.scheduler import PrefillChunk, ScheduledBatch
from kvledger.engine.planner.device import DeviceMemory

if TYPE_CHECKING:  # the runner pulls torch in
    from kvledger.engine.core.runner import StepOutput
    from kvledger.engine.core.sequence import Sequence


class RankRunner(Protocol):
    """What a rank's messages run on: its shard's ``ModelRunner``, or a pipeline stage's
    ``StageRunner``."""

    def profile(self, num_tokens: int, max_model_len: int, max_num_seqs: int,
                kv_dtype: str = "auto") -> int | None: ...

    def allocate_kv_cache(self, num_blocks: int, kv_dtype: str) -> int: ...

    def execute(self, batch: ScheduledBatch) -> StepOutput: ...


@dataclass(frozen=True)
class RankSpec:
    """What every rank needs to build its shard the way rank 0 builds its own."""

    model_dir: str
    world: int
    device: str  # "cpu" or "cuda"
    dtype: str  # the plan's model dtype, e.g. "float32"
    max_model_len: int
    block_size: int
    master_port: int
    timeout_s: float  # a collective not done by then fails (a rank is gone)
    threads: int | None = None  # torch threads for this rank (None: torch's default)
    fuse: bool = True  # fused projections (model/fusion.py); not with --enable-lora
    stages: int = 1  # --pipeline-parallel-size: rank r runs stage r // (world / stages)
    nodes: int = 1  # --nnodes: machine m runs ranks m * world / nodes onwards
    master_addr: str = "127.0.0.1"  # where rank 0's store listens (--master-addr)
    paged: bool = False  # attention reads the KV pool in place (--attention-backend)
    weight_reading: WeightReading = AS_VLLM_DEFAULTS  # --safetensors-load-strategy and co.
    prompt_logits: bool = False  # prompt logprobs report logits (--logprobs-mode *_logits)

    def device_index(self, rank: int) -> int:
        """``rank``'s GPU on its own machine."""
        return rank % (self.world // self.nodes)

    def reading(self, rank: int) -> WeightReading:
        """How ``rank`` reads the checkpoint: the ranks of one machine share the files'
        read ahead out (each machine reads its own copy)."""
        return dataclasses.replace(self.weight_reading,
                                   share=(self.device_index(rank), self.world // self.nodes))


class ParamsView(Struct, frozen=True):
    prompt_logprobs: int | None


class SeqView(Struct, frozen=True):
    """The fields of a ``Sequence`` the model runner reads."""

    request_id: str
    prompt_token_ids: list[int]
    num_prompt_tokens: int
    num_tokens: int
    last_token_id: int
    block_ids: list[int]
    prompt_logprobs: list | None
    params: ParamsView


class ChunkView(Struct, frozen=True):
    seq: SeqView
    start: int
    length: int


class StepView(Struct, frozen=True):
    """A ``ScheduledBatch`` as plain values: what ``ModelRunner.execute`` reads of it."""

    prefills: list[ChunkView]
    decodes: list[SeqView]
    fresh_blocks: list[int]

    def batch(self) -> ScheduledBatch:
        """The batch the runner executes (of ``SeqView``s)."""
        return ScheduledBatch([PrefillChunk(c.seq, c.start, c.length) for c in self.prefills],
                              list(self.decodes), list(self.fresh_blocks))


def seq_view(seq: Sequence, prompt_tokens: bool) -> SeqView:
    """``seq`` as plain values; its prompt only when this step computes part of it."""
    return SeqView(seq.request_id, list(seq.prompt_token_ids) if prompt_tokens else [],
                   seq.num_prompt_tokens, seq.num_tokens, seq.last_token_id,
                   list(seq.block_ids), None if seq.prompt_logprobs is None else [],
                   ParamsView(seq.params.prompt_logprobs))


def step_view(batch: ScheduledBatch) -> StepView:
    return StepView([ChunkView(seq_view(c.seq, True), c.start, c.length) for c in batch.prefills],
                    [seq_view(seq, False) for seq in batch.decodes], list(batch.fresh_blocks))


# The messages. Each is tagged with its class name on the wire; ``Message`` is their union.

class Hello(Struct, frozen=True, tag=True):
    rank: int
    fingerprint: str  # the protocol and the model's config.json (``nodes.fingerprint``)
    device: DeviceMemory | None


class Refused(Struct, frozen=True, tag=True):
    reason: str


class Start(Struct, frozen=True, tag=True):
    spec: RankSpec


class Ready(Struct, frozen=True, tag=True):
    rank: int


class Alive(Struct, frozen=True, tag=True):
    pass


class Profile(Struct, frozen=True, tag=True):
    num_tokens: int
    max_model_len: int
    max_num_seqs: int
    kv_dtype: str = "auto"

    def run(self, runner: RankRunner) -> int | None:
        return runner.profile(self.num_tokens, self.max_model_len, self.max_num_seqs,
                              self.kv_dtype)


class Measure(Struct, frozen=True, tag=True):
    """Profile, and answer with ``RankFigures`` (rank 0 re-plans every stage)."""

    profile: Profile


class AllocateKvCache(Struct, frozen=True, tag=True):
    num_blocks: int
    kv_dtype: str

    def run(self, runner: RankRunner) -> int:
        return runner.allocate_kv_cache(self.num_blocks, self.kv_dtype)


class Execute(Struct, frozen=True, tag=True):
    step: StepView

    def run(self, runner: RankRunner) -> StepOutput:
        return runner.execute(self.step.batch())


class Stop(Struct, frozen=True, tag=True):
    pass


class RankFigures(Struct, frozen=True, tag=True):
    """``Measure``'s answer: a rank's weights as loaded and a profiled step's activation
    peak (None on the CPU)."""

    weights_bytes: int
    activation_peak_bytes: int | None


Message = (Hello | Refused | Start | Ready | Alive | Profile | Measure | AllocateKvCache
           | Execute | Stop | RankFigures)
