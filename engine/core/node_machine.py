"""A machine of rank above 0 (``--nnodes N --node-rank R``, R > 0): no API, no scheduler;
its ranks as processes of their own, each joining machine 0 over the sealed control
channel (``core/nodes.py``) and then following its calls as a rank of machine 0 does
(``rank_worker.follow``). The machine ends with its ranks, and its ranks with it.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from dataclasses import replace
from typing import Any

from kvledger.engine.core.nodes import fingerprint, join
from kvledger.engine.errors import BadInput
from kvledger.engine.planner.device import DeviceMemory, probe_device
from kvledger.engine.settings.node_config import Nodes

log = logging.getLogger("kvledger.nodes")


def run_rank(nodes: Nodes, rank: int, model_dir: str, threads: int | None,
             device: DeviceMemory) -> None:
    """A process of another machine (multiprocessing's spawn target): join machine 0,
    then follow its calls as a rank of machine 0 does (``rank_worker.follow``)."""
    from kvledger.engine.core.rank_worker import follow, ignore_terminal_interrupt

    ignore_terminal_interrupt()  # Ctrl-C is this machine's serve's to handle
    logging.basicConfig(level=logging.INFO, format=f"rank {rank}: %(message)s")
    threading.Thread(target=_end_with, args=(os.getppid(),), daemon=True).start()
    code = 1
    try:
        channel, spec = join(nodes, rank, fingerprint(model_dir), device)
        channel.pulse()
        spec = replace(spec, model_dir=model_dir, threads=threads, master_addr=nodes.master_addr)
        code = follow(spec, rank, channel)
    except BaseException as exc:  # machine 0 gone, refused, or a broken shard
        log.error("rank %d failed: %s: %s", rank, type(exc).__name__, exc)
    sys.stdout.flush()
    os._exit(code)  # no process-group teardown: a peer may be gone


def _end_with(parent: int) -> None:
    """End this rank when its machine's ``kvledger serve`` is gone (killed -9, it could
    not end its ranks): a rank of no machine would hold machine 0's run open."""
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(1)


def run_node(config: Any, nodes: Nodes) -> int:
    """Machine ``nodes.rank`` (above 0): no API, no scheduler; its ranks as processes,
    each joining machine 0. The exit status: 0 when machine 0 stopped them (or SIGTERM),
    1 when one failed (the others are ended: the machines restart as a group)."""
    import multiprocessing

    import torch

    from kvledger.engine.checkpoint.hub.cache import serving_source
    from kvledger.engine.core.cpu_threads import cap_torch_threads

    world = config.tensor_parallel_size * config.pipeline_parallel_size
    ranks = nodes.ranks(world)
    source = serving_source(config.model, config.download_dir, hub_timeout_s=config.hub_timeout_s)
    device = probe_device(config)  # this machine's, before anything here touches it
    gpus = torch.cuda.device_count() if config.device != "cpu" else 0
    if gpus < len(ranks) and (config.device == "cuda" or gpus > 0):
        raise BadInput(f"machine {nodes.rank}: {len(ranks)} ranks here (--tensor-parallel-size "
                       f"x --pipeline-parallel-size / --nnodes), torch sees {gpus} CUDA devices")
    cap_torch_threads(torch)
    threads = max(1, torch.get_num_threads() // len(ranks)) if not gpus else None
    context = multiprocessing.get_context("spawn")
    processes = [context.Process(target=run_rank, args=(nodes, rank, source.path, threads,
                                                        device),
                                 name=f"kvledger-rank-{rank}", daemon=True) for rank in ranks]
    from kvledger.engine.core.rank_worker import terminal_interrupt_held

    with terminal_interrupt_held():
        for process in processes:
            process.start()
    log.info("machine %d of %d: ranks %d..%d joining %s:%d", nodes.rank, nodes.count,
             ranks[0], ranks[-1], nodes.master_addr, nodes.control_port)
    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    try:
        return _supervise(processes, stopping)
    finally:
        for process in processes:
            if process.is_alive():
                process.terminate()
            process.join(timeout=2.0)


def _supervise(processes: list, stopping: threading.Event) -> int:
    while not stopping.is_set():
        ended = [p for p in processes if not p.is_alive()]
        failed = [p for p in ended if p.exitcode != 0]
        if failed:
            log.error("%s exited (exit code %s): this machine's ranks stop", failed[0].name,
                      failed[0].exitcode)
            return 1
        if len(ended) == len(processes):
            log.info("machine 0 stopped the run")
            return 0
        stopping.wait(0.2)
    return 0
