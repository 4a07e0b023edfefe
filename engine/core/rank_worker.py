"""A rank other than 0 under ``--tensor-parallel-size N`` (or a pipeline stage after the
first, ``--pipeline-parallel-size``): its own process, its shard of the model (or its
stage's layers) and its own KV pool, and no scheduler, ledger or server. It
follows rank 0: each message on its link (a pipe, or the sealed channel from another
machine) is a call rank 0 makes on its own model runner (``profile``,
``allocate_kv_cache``, ``execute``), run here on the same inputs, so that both enter the
same collectives in the same order. A closed link (rank 0 gone) ends it. What crosses the
link is ``core/rank_messages.py``'s, as ``core/wire.py`` encodes it.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

from kvledger.engine.core.rank_messages import (
    AllocateKvCache,
    Execute,
    Measure,
    Profile,
    RankFigures,
    RankSpec,
    Ready,
    Stop,
)
from kvledger.engine.core.store_gate import StoreGate, keep_gloo_local, open_store
from kvledger.engine.core.wire import BadMessage, Link, PipeLink

if TYPE_CHECKING:  # torch's side, imported by the functions that build it (spawn stays light)
    from torch.distributed import ProcessGroup

    from kvledger.engine.core.runner import ModelRunner

log = logging.getLogger("kvledger.rank")


@contextmanager
def terminal_interrupt_held() -> Iterator[None]:
    """Start rank processes inside this block: they begin with Ctrl-C's SIGINT blocked (a
    thread's signal mask passes through fork and exec), until ``ignore_terminal_interrupt``
    ignores it. A terminal sends SIGINT to its whole foreground process group, ranks
    included, but the stop is rank 0's (or its machine's): it drains, then tells each rank
    to stop. A rank that took the signal itself would end mid-step, and print its
    KeyboardInterrupt, even while its interpreter is still starting."""
    from multiprocessing import resource_tracker

    # multiprocessing starts its resource tracker at the first spawn and unblocks SIGINT
    # after it, which would undo the block below: it is started first.
    resource_tracker.ensure_running()
    held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def ignore_terminal_interrupt() -> None:
    """A rank process's first step: SIGINT ignored (one that came meanwhile is dropped),
    then unblocked. SIGTERM still ends it, as its machine's ``stop`` sends it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def init_ranks(spec: RankSpec, rank: int, peers: Iterable[str] = ()) -> StoreGate | None:
    """Join the process group: gloo on the CPU, NCCL on CUDA (one GPU per rank). Rank 0
    opens the store (``core/store_gate.py``): with other machines, behind a gate that
    admits only ``peers`` (their addresses) and this machine, returned to be closed once
    every rank has joined."""
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        from kvledger.engine.errors import BadInput

        raise BadInput(f"--tensor-parallel-size {spec.world}: another tensor-parallel engine "
                       "runs in this process; one at a time")
    timeout = timedelta(seconds=spec.timeout_s)
    gate = None
    if rank == 0:
        store, gate = open_store(spec, peers)
    else:
        store = dist.TCPStore(spec.master_addr, spec.master_port, spec.world, False, timeout)
    backend = "nccl" if spec.device == "cuda" else "gloo"
    if spec.device == "cuda":
        torch.cuda.set_device(spec.device_index(rank))
    else:
        keep_gloo_local(spec)
    try:
        dist.init_process_group(backend, store=store, rank=rank, world_size=spec.world,
                                timeout=timeout)
    except BaseException:
        if gate is not None:
            gate.shutdown()
        raise
    return gate


def build_runner(spec: RankSpec, rank: int) -> ModelRunner:
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
                           torch.device("cpu") if tp > 1 else device, stage=stage,
                           reading=spec.reading(rank))
        model = shard_model(model, Ranks(rank % tp, tp, group)).to(device)
        runner = StageRunner(model, device, spec.max_model_len, spec.block_size,
                             fuse=spec.fuse, tp_rank=rank % tp, tp=tp, paged=spec.paged)
        runner.prompt_logits = spec.prompt_logits
        return runner
    # The whole checkpoint is read on the host, then cut: only the shard reaches the device.
    model = load_model(spec.model_dir, config, TORCH_DTYPES[spec.dtype], torch.device("cpu"),
                       reading=spec.reading(rank))
    model = shard_model(model, Ranks(rank, spec.world))
    model = model.to(device)
    runner = ModelRunner(model, device, spec.max_model_len, spec.block_size, fuse=spec.fuse,
                         paged=spec.paged)
    runner.prompt_logits = spec.prompt_logits
    return runner


def stage_groups(spec: RankSpec, rank: int) -> ProcessGroup | None:
    """The process group of ``rank``'s pipeline stage (its tensor-parallel ranks); every
    rank makes every stage's group, in the same order, as torch.distributed requires. None
    with one rank a stage."""
    import torch.distributed as dist

    tp = spec.world // spec.stages
    if tp == 1:
        return None
    groups = [dist.new_group(list(range(s * tp, (s + 1) * tp))) for s in range(spec.stages)]
    return groups[rank // tp]


def measure(runner: ModelRunner, profile: Profile) -> RankFigures:
    """This rank's weights as loaded and ``profile``'s activation peak (None on the CPU),
    for rank 0's re-plan of every pipeline stage."""
    from kvledger.engine.model.loader import weights_bytes

    return RankFigures(weights_bytes(runner.model), profile.run(runner))


def follow(spec: RankSpec, rank: int, link: Link) -> int:
    """Rank ``rank``'s life: join, build, then run rank 0's calls until told to stop or
    rank 0 is gone; the exit status. ``link`` sends and receives rank messages."""
    import torch

    if spec.threads:
        torch.set_num_threads(spec.threads)
    init_ranks(spec, rank)
    runner = build_runner(spec, rank)
    link.send(Ready(rank))
    while True:
        try:
            call = link.recv()
        except (EOFError, OSError):
            log.error("rank %d: rank 0 is gone; exiting", rank)
            return 1
        except BadMessage as exc:
            log.error("rank %d: rank 0 sent what is no call (%s); exiting", rank, exc)
            return 1
        if isinstance(call, Stop):
            return 0
        if isinstance(call, Measure):  # the one call answered: rank 0 waits for every rank's
            link.send(measure(runner, call.profile))
        elif isinstance(call, Profile | AllocateKvCache | Execute):
            call.run(runner)
        else:
            log.error("rank %d: rank 0 sent a %s, not a call; exiting", rank,
                      type(call).__name__)
            return 1


def main(spec: RankSpec, rank: int, conn: Connection) -> None:
    """The process's entry point (multiprocessing's spawn target): its end of a pipe."""
    ignore_terminal_interrupt()
    logging.basicConfig(level=logging.INFO, format=f"rank {rank}: %(message)s")
    try:
        code = follow(spec, rank, PipeLink(conn))
    except BaseException as exc:  # a failed collective (rank 0 died) or a broken shard
        log.error("rank %d failed: %s: %s", rank, type(exc).__name__, exc)
        code = 1
    sys.stdout.flush()
    os._exit(code)  # no process-group teardown: a peer may be gone
