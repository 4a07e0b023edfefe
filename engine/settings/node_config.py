"""The machines a served run spans, as vLLM's multi-node flags declare them: ``--nnodes N``,
``--node-rank R``, ``--master-addr ADDR``, ``--master-port PORT`` and ``--headless`` on
every machine but the first. Machine 0 serves the API and holds the scheduler, the
ledger and admission (rank 0); every machine runs ``world / N`` ranks, machine R ranks
``R * world / N`` onwards. The ranks meet at ``ADDR:PORT`` (torch.distributed's store)
and machine 0 sends its calls over ``ADDR:PORT+1`` (``core/nodes.py``), a channel whose
every frame is sealed with keys derived from ``$KVLEDGER_NODE_KEY``.

Torch-free: ``kvledger serve`` checks the flags before anything loads.
"""

from __future__ import annotations

import argparse
import os
import random
import socket
from dataclasses import dataclass

from kvledger.engine.errors import BadInput

NODE_KEY_ENV = "KVLEDGER_NODE_KEY"
DEFAULT_MASTER_ADDR = "127.0.0.1"  # vLLM's defaults (its ParallelConfig)
DEFAULT_MASTER_PORT = 29501
MIN_KEY_BYTES = 16


@dataclass(frozen=True)
class Nodes:
    """This machine's place in a run of ``count`` machines."""

    count: int
    rank: int
    master_addr: str
    master_port: int
    key: bytes  # the group's secret: the control channel's keys derive from it (core/sealed.py)

    @property
    def control_port(self) -> int:
        return self.master_port + 1

    def ranks(self, world: int) -> range:
        """The global ranks this machine runs (``world`` ranks over ``count`` machines)."""
        local = world // self.count
        return range(self.rank * local, (self.rank + 1) * local)


def add_node_flags(parser: argparse.ArgumentParser) -> None:
    """vLLM's multi-node flags (``kvledger serve``'s "machines" group)."""
    nodes = parser.add_argument_group(
        "machines", "vLLM's multi-node flags: the ranks (-tp x -pp) split evenly over N "
        f"machines; each needs ${NODE_KEY_ENV}, the same secret on every machine")
    nodes.add_argument("--nnodes", "-n", type=int, default=1, metavar="N",
                       help="machines the run spans (default 1)")
    nodes.add_argument("--node-rank", "-r", type=int, default=0, metavar="R",
                       help="this machine's rank, 0..N-1: 0 serves the API, the others "
                            "run their ranks only (default 0)")
    nodes.add_argument("--master-addr", default=DEFAULT_MASTER_ADDR, metavar="ADDR",
                       help=f"machine 0's address (default {DEFAULT_MASTER_ADDR})")
    nodes.add_argument("--master-port", type=int, default=DEFAULT_MASTER_PORT, metavar="PORT",
                       help="machine 0's port for torch.distributed's rendezvous; PORT+1 "
                            f"carries its calls to the other machines (default "
                            f"{DEFAULT_MASTER_PORT})")
    nodes.add_argument("--headless", action="store_true",
                       help="vLLM's: serve no API (every machine but the first; a machine of "
                            "rank above 0 is headless with it or without)")


def nodes_from_args(args: argparse.Namespace, world: int) -> Nodes | None:
    """The machines the flags declare; None for one machine. BadInput for flags that
    cannot make a run of ``world`` ranks (``-tp x -pp``)."""
    count, rank = args.nnodes, args.node_rank
    if count < 1:
        raise BadInput(f"--nnodes must be at least 1, got {count}")
    if not 0 <= rank < count:
        raise BadInput(f"--node-rank must be in 0..{count - 1} (--nnodes {count}), got {rank}")
    if args.headless and rank == 0:
        raise BadInput("--headless: machine 0 (--node-rank 0) serves the API; give --headless "
                       "to the other machines")
    if count == 1:
        return None
    if world % count:
        raise BadInput(f"--nnodes {count}: the {world} ranks (--tensor-parallel-size x "
                       f"--pipeline-parallel-size) do not split evenly over {count} machines")
    if not 1 <= args.master_port <= 65534:
        raise BadInput(f"--master-port must be in 1..65534 (PORT+1 is used too), got "
                       f"{args.master_port}")
    key = os.environ.get(NODE_KEY_ENV, "").encode()
    if len(key) < MIN_KEY_BYTES:
        raise BadInput(f"--nnodes {count}: set ${NODE_KEY_ENV} to the same secret of "
                       f"{MIN_KEY_BYTES} characters or more on every machine (e.g. "
                       "`openssl rand -hex 32`); the machines prove they hold it before "
                       "machine 0 sends them anything")
    return Nodes(count, rank, args.master_addr, args.master_port, key)


def free_port_pair(host: str = "127.0.0.1") -> int:
    """A free port P with P + 1 free too: a run's rendezvous and control channel on one
    machine (``kvledger run`` of a group, tests, benches). Drawn below the kernel's
    ephemeral range where it can be, so the outgoing connections of other programs, which
    take ports from that range, cannot take P or P + 1 before the engine binds them."""
    low = _ephemeral_low()
    draw = random.Random()
    for _ in range(100):
        port = (draw.randrange(_QUIET_FLOOR, low - 1) if low - 1 > _QUIET_FLOOR
                else _bound_port(host))
        if _free(host, port) and _free(host, port + 1):
            return port
    raise BadInput(f"no two adjacent free ports at {host}")


# Below the ephemeral range, above the ports well-known services and their peers take.
_QUIET_FLOOR = 20000


def _ephemeral_low() -> int:
    """The first port the kernel hands out for outgoing connections (Linux's
    ip_local_port_range; 32768, its default, elsewhere)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as ranges:
            return int(ranges.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bound_port(host: str) -> int:
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def _free(host: str, port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True
