"""Rank 0 starting the other ranks of a sharded engine (``--tensor-parallel-size``,
``--pipeline-parallel-size``, ``--nnodes``): what each rank is told (``RankSpec``), the
threads they share on one machine, and the plan made again on the smallest machine that
joins, before any rank loads a byte."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from kvledger.engine.errors import BadInput, DoesNotFit
from kvledger.engine.planner.device import DeviceMemory
from kvledger.engine.planner.estimates import format_size
from kvledger.engine.planner.plan import Plan, make_plan
from kvledger.engine.planner.report import render_report
from kvledger.engine.settings.config import EngineConfig
from kvledger.engine.settings.node_config import DEFAULT_MASTER_ADDR

if TYPE_CHECKING:
    from kvledger.engine.core.ranks import RankedRunner

log = logging.getLogger("kvledger.engine")


def start_ranks(config: EngineConfig, plan: Plan, source, device: torch.device,
                probed: DeviceMemory, *, paged: bool) -> tuple[RankedRunner, DeviceMemory]:
    """Rank 0's runner under ``--tensor-parallel-size N`` (or ``--pipeline-parallel-size
    P``), and the device to plan on: ranks 1..N-1 started as their own processes
    (``core/ranks.py``; with ``--nnodes``, this machine's, the others' joining over the
    network), every rank holding its shard (its stage); BadInput when torch sees fewer
    CUDA devices than ranks (what cannot be sharded, the plan refused first).

    With ``--nnodes`` every other machine names its device as it joins; the smallest
    (less free memory than ``probed``) is planned on again before any rank loads, and a
    plan that no longer fits it is refused (DoesNotFit) on every machine. ``paged``: the
    ranks' attention reads the block pool in place (``startup.reads_in_place``)."""
    # Imported here: a start of one rank, the most common, never pays for them.
    from kvledger.engine.core.rank_messages import RankSpec
    from kvledger.engine.core.ranks import RANK_TIMEOUT_S, RankedRunner, RankGroup, free_port

    # Shardable, and stages of one GPU each: the plan and check_stages said so.
    stages, nodes = config.pipeline_parallel_size, config.nodes
    world = config.tensor_parallel_size * stages
    local = world // nodes.count if nodes else world  # this machine's ranks
    if device.type == "cuda" and torch.cuda.device_count() < local:
        raise BadInput(f"{local} ranks on this machine (--tensor-parallel-size x "
                       f"--pipeline-parallel-size / --nnodes): torch sees "
                       f"{torch.cuda.device_count()} CUDA devices")
    threads = max(1, torch.get_num_threads() // local) if device.type == "cpu" else None
    spec = RankSpec(model_dir=source.path, world=world, device=device.type,
                    dtype=plan.model_dtype, max_model_len=plan.max_model_len,
                    block_size=plan.kv.block_size,
                    master_port=nodes.master_port if nodes else free_port(),
                    timeout_s=RANK_TIMEOUT_S, threads=threads, fuse=not config.enable_lora,
                    stages=stages, nodes=nodes.count if nodes else 1,
                    master_addr=nodes.master_addr if nodes else DEFAULT_MASTER_ADDR,
                    paged=paged, weight_reading=config.weight_reading,
                    prompt_logits=config.logprobs_mode.endswith("logits"))
    planned_on = [probed]

    def plan_on_machines(devices: dict[int, DeviceMemory | None]) -> None:
        known = [(d.free_bytes, rank, d) for rank, d in devices.items() if d is not None]
        if not known or min(known)[0] >= probed.free_bytes:
            return
        _, rank, smallest = min(known)
        planned_on[0] = smallest
        again = make_plan(config, device=smallest, source=source)
        where = (f"rank {rank}'s machine (--node-rank {rank // local}): {smallest.name}, "
                 f"{format_size(smallest.free_bytes)} free")
        if not again.fits:
            raise DoesNotFit(f"the plan does not fit {where}, less than this machine's\n"
                             + render_report(again), again)
        log.info("planned on %s, less than this machine's", where)

    group = RankGroup(spec, nodes, plan_on_machines if nodes else None)
    if threads:
        group.threads_before = torch.get_num_threads()  # given back when the ranks stop
        torch.set_num_threads(threads)  # the ranks share this machine's cores
    return RankedRunner(group.start(), group), planned_on[0]
