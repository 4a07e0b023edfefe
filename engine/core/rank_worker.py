"""A rank other than 0 under ``--tensor-parallel-size N`` (or a pipeline stage after the
first, ``--pipeline-parallel-size``): its own process, its shard of the model (or its
stage's layers) and its own KV pool, and no scheduler, ledger or server. It
follows rank 0: each message on its pipe is a call rank 0 makes on its own model runner
(``profile``, ``allocate_kv_cache``, ``execute``), run here on the same inputs, so that
both enter the same collectives in the same order. A closed pipe (rank 0 gone) ends it.

``StepView`` is what ``execute`` reads of a scheduled batch, as plain values: the batch
itself holds reservations, grammars and generators that stay in rank 0.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

log = logging.getLogger("kvledger.rank")


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

    def device_index(self, rank: int) -> int:
        """``rank``'s GPU on its own machine."""
        return rank % (self.world // self.nodes)


@dataclass(frozen=True)
class ParamsView:
    prompt_logprobs: int | None


@dataclass(frozen=True)
class SeqView:
    """The fields of a ``Sequence`` the model runner reads."""

    request_id: str
    prompt_token_ids: list[int]
    num_prompt_tokens: int
    num_tokens: int
    last_token_id: int
    block_ids: list[int]
    prompt_logprobs: list | None
    params: ParamsView


def seq_view(seq: Any, prompt_tokens: bool) -> SeqView:
    """``seq`` as plain values; its prompt only when this step computes part of it."""
    return SeqView(seq.request_id, list(seq.prompt_token_ids) if prompt_tokens else [],
                   seq.num_prompt_tokens, seq.num_tokens, seq.last_token_id,
                   list(seq.block_ids), None if seq.prompt_logprobs is None else [],
                   ParamsView(seq.params.prompt_logprobs))


def batch_view(batch: Any) -> Any:
    """A ``ScheduledBatch`` of ``SeqView``s: what ``ModelRunner.execute`` reads of it."""
    from kvledger.engine.core.scheduler import PrefillChunk, ScheduledBatch

    return ScheduledBatch(
        prefills=[PrefillChunk(seq_view(c.seq, True), c.start, c.length) for c in batch.prefills],
        decodes=[seq_view(seq, False) for seq in batch.decodes],
        fresh_blocks=list(batch.fresh_blocks))


def init_ranks(spec: RankSpec, rank: int) -> None:
    """Join the process group: gloo on the CPU, NCCL on CUDA (one GPU per rank)."""
    import torch
    import torch.distributed as dist

    os.environ["MASTER_ADDR"] = spec.master_addr
    os.environ["MASTER_PORT"] = str(spec.master_port)
    if dist.is_initialized():
        from kvledger.engine.errors import BadInput

        raise BadInput(f"--tensor-parallel-size {spec.world}: another tensor-parallel engine "
                       "runs in this process; one at a time")
    backend = "nccl" if spec.device == "cuda" else "gloo"
    if spec.device == "cuda":
        torch.cuda.set_device(spec.device_index(rank))
    dist.init_process_group(backend, rank=rank, world_size=spec.world,
                            timeout=timedelta(seconds=spec.timeout_s))


def build_runner(spec: RankSpec, rank: int) -> Any:
    """This rank's shard, on its device, in a model runner."""
    import torch

    from kvledger.engine.checkpoint.model_config import ModelConfig
    from kvledger.engine.core.runner import TORCH_DTYPES, ModelRunner
    from kvledger.engine.model.loader import load_model
    from kvledger.engine.model.tensor_parallel import Ranks, shard_model

    config = ModelConfig.from_dir(spec.model_dir)
    device = (torch.device("cuda", spec.device_index(rank)) if spec.device == "cuda"
              else torch.device("cpu"))
    if spec.stages > 1:  # this rank's stage: only its tensors are read (model/pipeline.py)
        from kvledger.engine.core.stage_runner import StageRunner
        from kvledger.engine.model.pipeline import Stage

        tp = spec.world // spec.stages
        group = stage_groups(spec, rank)
        stage = Stage.of(config, rank // tp, spec.stages)
        model = load_model(spec.model_dir, config, TORCH_DTYPES[spec.dtype],
                           torch.device("cpu") if tp > 1 else device, stage=stage)
        model = shard_model(model, Ranks(rank % tp, tp, group)).to(device)
        return StageRunner(model, device, spec.max_model_len, spec.block_size, fuse=spec.fuse,
                           tp_rank=rank % tp, tp=tp)
    # The whole checkpoint is read on the host, then cut: only the shard reaches the device.
    model = load_model(spec.model_dir, config, TORCH_DTYPES[spec.dtype], torch.device("cpu"))
    model = shard_model(model, Ranks(rank, spec.world))
    model = model.to(device)
    return ModelRunner(model, device, spec.max_model_len, spec.block_size, fuse=spec.fuse)


def stage_groups(spec: RankSpec, rank: int) -> Any:
    """The process group of ``rank``'s pipeline stage (its tensor-parallel ranks); every
    rank makes every stage's group, in the same order, as torch.distributed requires. None
    with one rank a stage."""
    import torch.distributed as dist

    tp = spec.world // spec.stages
    if tp == 1:
        return None
    groups = [dist.new_group(list(range(s * tp, (s + 1) * tp))) for s in range(spec.stages)]
    return groups[rank // tp]


def measure(runner: Any, *profile_args: Any) -> dict[str, int | None]:
    """This rank's weights as loaded and a profiled step's activation peak (``profile``'s
    arguments; None on the CPU), for rank 0's re-plan of every pipeline stage."""
    from kvledger.engine.model.loader import weights_bytes

    return {"weights_bytes": weights_bytes(runner.model),
            "activation_peak_bytes": runner.profile(*profile_args)}


def follow(spec: RankSpec, rank: int, conn: Any) -> int:
    """Rank ``rank``'s life: join, build, then run rank 0's calls until told to stop or
    rank 0 is gone; the exit status."""
    import torch

    if spec.threads:
        torch.set_num_threads(spec.threads)
    init_ranks(spec, rank)
    runner = build_runner(spec, rank)
    conn.send(("ready", rank))
    while True:
        try:
            method, args = conn.recv()
        except (EOFError, OSError):
            log.error("rank %d: rank 0 is gone; exiting", rank)
            return 1
        if method == "stop":
            return 0
        if method == "measure":  # the one call answered: rank 0 waits for every rank's
            conn.send(measure(runner, *args))
            continue
        getattr(runner, method)(*args)


def main(spec: RankSpec, rank: int, conn: Any) -> None:
    """The process's entry point (multiprocessing's spawn target)."""
    logging.basicConfig(level=logging.INFO, format=f"rank {rank}: %(message)s")
    try:
        code = follow(spec, rank, conn)
    except BaseException as exc:  # a failed collective (rank 0 died) or a broken shard
        log.error("rank %d failed: %s: %s", rank, type(exc).__name__, exc)
        code = 1
    sys.stdout.flush()
    os._exit(code)  # no process-group teardown: a peer may be gone
