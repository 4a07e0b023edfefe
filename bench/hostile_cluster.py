"""The operator's admission webhook under attack, replayed as an attacker in the cluster
would: the real operator (``kvledger operator --webhook-port``, its own process, as
tests/webhook_harness.py runs it against kmock's Kubernetes emulator) and a hostile hub
stand-in on 127.0.0.1 (tests/hub_server.py serving tests/hostile_hub.py's repos). Each
section starts its own operator, so each memory figure is that attack's alone; each prints
its figures, and the script exits 1 (a ``hostile_cluster: FAILED:`` line each) when an
attack gets what it should not.

    .venv/bin/python bench/hostile_cluster.py [--fast] [--only SECTION ...]

The attacks (hostile round four):

- hub_headers: a public hub repo whose index names 6 shards of 95 MB safetensors headers,
  applied once (``--dry-run=server``): the operator's memory, the bytes it pulls, the
  answer's time;
- hub_wide: 6 distinct repos at once, each a mixture of experts of 64,893 tensors in
  12.5 MiB of index and headers (as big as the operator reads): the memory;
- preflight_headers: ``kvledger plan`` (the pod's pre-flight) on the 6 x 95 MB repo: its
  peak memory, its exit;
- tls_idle: 1,000 TLS connections that only handshake, and 200 TCP ones that never start
  TLS: the memory, and how many are still open afterwards;
- slow_bodies: 2,000 connections each sending 60 kB of a 1 MB body, then nothing; and
  2,000 sending 60 kB of a 120 kB one: the memory, and how they end;
- review_flood: 150 concurrent reviews of distinct specs on a cached 70B, and cheap reviews
  (gpus 0, an unchanged spec, a cached plan) sent meanwhile: the slowest answer, the cheap
  ones';
- malformed_reviews: bodies that are a list, null, {}, a non-object request or object, a
  string metadata, a list spec, a bogus apiVersion/kind, a dict uid: status and text;
- update_memos: 50,000 UPDATE reviews of made-up uids: the memory they leave;
- sigterm_reads: SIGTERM with 16 hub reads under way or queued on a dripping hub: the time
  the operator takes to exit;
- nodes_channel: the multi-machine control channel and torch's store
  (``bench/hostile_nodes.py``: a relay on the path injecting a pickled frame and reading
  the prompts, a flood of connections, a dripping handshake, a stranger at the store).

``--fast`` runs every section smaller (tests/bench/test_bench_scripts.py); ``main()`` runs
the sections of ``SECTIONS``, each ``async (args, report) -> None``.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "bench")]

import hostile_nodes  # noqa: E402
from hostile_connections import malformed_reviews, slow_bodies, tls_idle, update_memos  # noqa: E402
from hostile_hub_attacks import (  # noqa: E402
    hub_headers,
    hub_wide,
    preflight_headers,
    review_flood,
    sigterm_reads,
)


async def nodes_channel(args, report) -> None:
    """The machines' control channel and torch's store (bench/hostile_nodes.py's attacks;
    ``--fast``: the relay on the path only, not the live two-machine run)."""
    failed: list[str] = []
    folder = args.tmp / "nodes"
    folder.mkdir()
    await asyncio.to_thread(hostile_nodes.run_all, folder, failed, live=not args.fast)
    report.check("a relay injecting a pickled frame, reading prompts; a flood, a drip, a "
                 "stranger at the store" + (" (relay only)" if args.fast else ""),
                 "; ".join(failed) or "each refused", "none gets what it should not",
                 not failed)


SECTIONS = [hub_headers, hub_wide, preflight_headers, tls_idle, slow_bodies, review_flood,
            malformed_reviews, update_memos, sigterm_reads, nodes_channel]


class Report:
    """What each attack got, and whether that is what it should get."""

    def __init__(self) -> None:
        self.rows: list[tuple[str, str, str, bool]] = []

    def check(self, attack: str, figure: str, claim: str, held: bool) -> None:
        self.rows.append((attack, figure, claim, held))
        print(f"{attack}: {figure} (claim: {claim}: {'held' if held else 'FAILED'})",
              flush=True)

    @property
    def failed(self) -> list[str]:
        return [f"{attack}: {figure} (claim: {claim})"
                for attack, figure, claim, held in self.rows if not held]


def main() -> int:
    names = [section.__name__ for section in SECTIONS]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fast", action="store_true",
                        help="every section smaller (the test's mode)")
    parser.add_argument("--only", nargs="+", choices=names, default=names, metavar="SECTION",
                        help=f"run only these sections ({', '.join(names)})")
    args = parser.parse_args()
    report = Report()
    with tempfile.TemporaryDirectory() as tmp:
        args.tmp = Path(tmp)
        for section in SECTIONS:
            if section.__name__ in args.only:
                print(f"== {section.__name__}", flush=True)
                asyncio.run(section(args, report))
    print("\n| attack | now | claim | |\n|---|---|---|---|")
    for attack, figure, claim, held in report.rows:
        print(f"| {attack} | {figure} | {claim} | {'held' if held else 'FAILED'} |")
    for line in report.failed:
        print(f"hostile_cluster: FAILED: {line}", file=sys.stderr)
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
