"""What ``--admission safe`` costs the engine's step: its admission and draw checks, timed
on the real ``KVLedger`` at a CPU test's scale and at a GPU's.

``--admission safe`` over-commits the KV pool while every admitted request can still
reach its cap (engine/kv/safety.py): an admission is checked against the projected peak
and the banker's order, and once over-committed each block a request draws is checked
too. These checks run in the engine's step, in Python, under the ledger's lock, so their
cost must stay small beside a step's forward pass at a GPU's hundreds of requests over
tens of thousands of blocks.

This runs one seeded workload per scale with no model: each simulated step first tries
to admit the oldest waiting request (strict FIFO, at most ``max_num_seqs`` live; it is
seated at once), then asks the ledger for the request to run first (``head``, as the
scheduler does each step), then every live request writes one token (``grow``), the
head first, and those at their caps release. Prompts
are one of 8 system prompts of 256 tokens then 16-256 of their own (prefix caching on, so
the system prompts' blocks are shared), caps 64-2048 (a quarter of them unset, up to the
4096-token context), 16 tokens a block; the queue never empties. Measured per scale: the mean wall time of an admission
attempt, of a ``head`` and of a ``grow`` that draws a block, the ledger's time per step (every call),
how often the pool was over-committed, and the mean live requests. ``--admission
reserve`` runs the same workload for comparison.

    .venv/bin/python bench/safe_checks.py [--steps 3000] [--scales 32 256 1024] [--json]

Exit status 1 (one ``safe_checks: FAILED:`` line each) when a run breaks the guarantee:
a request that could not advance while nothing could, or a pool not empty at the end.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time

from kvledger.engine.kv.ledger import KVLedger

BLOCK_SIZE = 16
# (live requests at most, pool blocks): a CPU test's engine, a mid-size and a large GPU's.
SCALES = ((32, 2048), (256, 8192), (1024, 65536))


def run(max_live: int, num_blocks: int, steps: int, safe: bool, seed: int) -> dict:
    rng = random.Random(seed)
    context = 4096
    ledger = KVLedger(num_blocks, BLOCK_SIZE, enable_prefix_caching=True, overcommit=safe,
                      max_live=max_live)
    systems = [[rng.randrange(1, 32000) for _ in range(256)] for _ in range(8)]
    live: list[list] = []  # [reservation, tokens written, prompt + cap]
    admit_s, draw_s, head_s, step_s = [], [], [], 0.0
    overcommitted = live_sum = stuck = 0
    head = None
    for _ in range(steps):
        if head is None:
            ids = [*rng.choice(systems), *(rng.randrange(1, 32000)
                                           for _ in range(rng.randrange(16, 257)))]
            total = context if rng.random() < 0.25 else len(ids) + rng.randrange(64, 2049)
            head = (ids, min(total, context))
        started = time.perf_counter()
        reservation = None
        if len(live) < max_live:
            reservation = ledger.try_reserve(head[1], head[0])
            admit_s.append(time.perf_counter() - started)
        if reservation is not None:
            ledger.seat(reservation)
            live.append([reservation, reservation.num_cached_tokens, head[1], head[0]])
            head = None
        began = time.perf_counter()
        first = ledger.head()
        head_s.append(time.perf_counter() - began)
        if first is not None:  # it draws first, as the scheduler runs it
            live.sort(key=lambda entry: entry[0] is not first)
        advanced = False
        for entry in list(live):
            reservation, written, total, prompt = entry
            # The prompt in one step, then a token a step.
            want = min(total, max(len(prompt), written + 1))
            drawing = ledger.blocks_for(want) > len(reservation.block_ids)
            began = time.perf_counter()
            entry[1] = ledger.grow(reservation, want)
            if drawing:
                draw_s.append(time.perf_counter() - began)
            advanced |= entry[1] > written
            if written < len(prompt) <= entry[1]:
                ledger.prefix_cache.register(reservation, prompt, len(prompt))
            if entry[1] == total:
                ledger.release(reservation)
                live.remove(entry)
        step_s += time.perf_counter() - started
        stuck += bool(live) and not advanced
        overcommitted += ledger.reserved_blocks > num_blocks
        live_sum += len(live)
    for reservation, *_ in live:
        ledger.release(reservation)
    ms = 1e3
    return {
        "admission": "safe" if safe else "reserve",
        "max_num_seqs": max_live, "blocks": num_blocks,
        "admission_check_ms": round(ms * sum(admit_s) / max(len(admit_s), 1), 3),
        "draw_ms": round(ms * sum(draw_s) / max(len(draw_s), 1), 4),
        "head_ms": round(ms * sum(head_s) / max(len(head_s), 1), 3),
        "ledger_ms_per_step": round(ms * step_s / steps, 3),
        "overcommitted_steps": round(overcommitted / steps, 2),
        "mean_live": round(live_sum / steps, 1),
        "steps_nobody_advanced": stuck,
        "pool_empty_after": ledger.used_blocks == 0 and ledger.reserved_blocks == 0,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--scales", type=int, nargs="+", default=[s for s, _ in SCALES],
                        metavar="MAX_NUM_SEQS", help="run only these of the scales")
    args = parser.parse_args(argv)
    rows = [run(live, blocks, args.steps, safe, args.seed)
            for live, blocks in SCALES if live in args.scales for safe in (False, True)]
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print("| admission | live at most | blocks | admission check | head | draw "
              "| ledger per step | over-committed steps | mean live |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in rows:
            print(f"| {r['admission']} | {r['max_num_seqs']} | {r['blocks']} | "
                  f"{r['admission_check_ms']} ms | {r['head_ms']} ms | {r['draw_ms']} ms | "
                  f"{r['ledger_ms_per_step']} ms | {r['overcommitted_steps']:.0%} | "
                  f"{r['mean_live']} |")
    failed = [r for r in rows if not r["pool_empty_after"] or r["steps_nobody_advanced"]]
    for r in failed:
        print(f"safe_checks: FAILED: {r['admission']} at {r['max_num_seqs']}/{r['blocks']}: "
              f"{r['steps_nobody_advanced']} steps where no request advanced, pool empty "
              f"after: {r['pool_empty_after']}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
