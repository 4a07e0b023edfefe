"""Does ``--admission safe`` always make progress? Random traffic through the real engine
loop (``LLMEngine.step``, ``Scheduler``, ``KVLedger``; only the forward pass faked, as in
tests/_sim_engine.py), many runs, tight pools.

Each run draws an engine (4-24 blocks of 1, 2 or 4 tokens, 1-4 seats, a token budget of
seats + 0-6, LoRA off or 1-3 slots over 2-4 adapters, prefix caching on or off, EOS
early finishes or not) and a stream of requests (prompts from three shared prefixes, caps
1-12, ``n`` of 1-3, a tenth of them aborted a few steps in), admitted as the server
admits them and stepped until every one has finished. Half the runs switch admission's
peak projection off: the guarantee must rest on the check and the head alone.

After every step: a step with requests in the engine computed at least one token, and
(``--check``) the state is safe by a brute-force search over completion orders. At the
end: every admitted request finished, the ledger is back at zero. Reported: runs, steps,
over-committed steps, steps with a paused request, heads seated from the line, seats
refused, the most steps one request sat out in a row, and failures.

    .venv/bin/python bench/safe_progress.py [--runs 2000] [--seed 0] [--check]

Exit status 1 (a ``safe_progress: FAILED:`` line) when any step computed nothing while
requests waited, any state was unsafe, or any admitted request did not finish.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from _sim_engine import Adapter, brute_force_safe, sim_engine, submit  # noqa: E402

from kvledger.engine.errors import PoolTooSmall  # noqa: E402
from kvledger.engine.kv import safety  # noqa: E402
from kvledger.engine.model.builtin import write_model  # noqa: E402

PREFIXES = ([2, 3, 4, 5, 6, 7, 8, 9], [40] * 6, [11, 12, 13])


class Tally:
    def __init__(self) -> None:
        self.runs = self.steps = self.overcommitted = self.paused_steps = 0
        self.heads_from_line = self.seats_refused = self.worst_sat_out = 0
        self.admitted = self.refused = 0
        self.failures: list[str] = []


def one_run(model_dir: Path, rng: random.Random, tally: Tally, check: bool) -> None:
    projection = rng.random() < 0.5
    loras = rng.choice([None, (1, 2), (1, 3), (2, 3), (2, 4), (3, 4)])
    max_loras, adapter_count = loras or (None, 0)
    seats = rng.randint(1, 4)
    engine = sim_engine(model_dir, num_blocks=rng.randint(4, 24),
                        block_size=rng.choice([1, 2, 4]), max_num_seqs=seats,
                        max_num_batched_tokens=seats + rng.randint(0, 6), max_loras=max_loras,
                        prefix_caching=rng.random() < 0.7,
                        eos_rate=rng.choice([0.0, 0.2]), seed=rng.randrange(2**16))
    adapters = [None] + [Adapter(f"a{i}", i + 1) for i in range(adapter_count)]
    ledger, scheduler = engine.ledger, engine.scheduler
    seat = scheduler._seat
    seat_head = scheduler._seat_head
    heads = [0, 0]  # seated from the line, seats refused

    def counted_seat(seq):
        seated = seat(seq)
        heads[1] += not seated
        return seated

    def counted_head():
        waiting = {id(s) for s in scheduler.waiting}
        seq = seat_head()
        heads[0] += seq is not None and id(seq) in waiting
        return seq

    scheduler._seat, scheduler._seat_head = counted_seat, counted_head
    real_peak = safety.peak_blocks
    if not projection:
        safety.peak_blocks = lambda timelines, block_size: 0
    try:
        arrivals, live, sat_out, aborts = rng.randint(5, 30), set(), {}, []
        number = 0
        for step in range(5000):
            if arrivals and rng.random() < 0.5:
                prompt = [*rng.choice(PREFIXES), *(rng.randint(20, 90)
                                                   for _ in range(rng.randint(0, 6)))]
                cap, n = rng.randint(1, 12), rng.choice([1, 1, 2, 3])
                try:
                    ledger.check_fits(len(prompt) + cap, n, len(prompt), share=True)
                except PoolTooSmall:
                    arrivals -= 1
                    continue
                paused = ledger.paused_reservations
                ids = submit(engine, f"r{number}", prompt, cap, n=n,
                             adapter=rng.choice(adapters), ignore_eos=rng.random() < 0.5)
                if ids is None:
                    tally.refused += 1
                else:
                    if paused:
                        tally.failures.append("admitted while a request was paused")
                    arrivals, number = arrivals - 1, number + 1
                    tally.admitted += 1
                    live.update(ids)
                    if rng.random() < 0.1:
                        aborts.append((step + rng.randint(0, 5), rng.choice(ids)))
            for when, request_id in [a for a in aborts if a[0] <= step]:
                engine.abort_request(request_id)
                aborts.remove((when, request_id))
            if not arrivals and not engine.has_unfinished_requests():
                break
            ran = len(engine.runner.batches)
            for out in engine.step():
                if out.finished:
                    live.discard(out.request_id)
            tally.steps += 1
            tally.overcommitted += ledger.reserved_blocks > ledger.num_blocks
            tally.paused_steps += ledger.paused_reservations > 0
            for reservation in ledger.overcommit.paused:
                sat_out[reservation] = sat_out.get(reservation, 0) + 1
                tally.worst_sat_out = max(tally.worst_sat_out, sat_out[reservation])
            for reservation in [r for r in sat_out if r not in ledger.overcommit.paused]:
                del sat_out[reservation]
            if scheduler.has_unfinished() and len(engine.runner.batches) == ran:
                tally.failures.append(f"a step computed nothing: {scheduler.describe()}")
                return
            if check and not brute_force_safe(engine):
                tally.failures.append(f"unsafe state: {scheduler.describe()}")
                return
        if live or ledger.used_blocks or ledger.reserved_blocks or ledger.overcommit.live:
            tally.failures.append(f"unfinished at the end ({sorted(live)}): {scheduler.describe()}")
    finally:
        safety.peak_blocks = real_peak
        tally.runs += 1
        tally.heads_from_line += heads[0]
        tally.seats_refused += heads[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--check", action="store_true",
                        help="check every state by brute force (slower)")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    rng = random.Random(args.seed)
    tally = Tally()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_model("tiny-llama", Path(tmp) / "tiny-llama")
        for _ in range(args.runs):
            one_run(model_dir, rng, tally, args.check)
            if tally.failures:
                break
    elapsed = time.perf_counter() - started
    print(f"runs {tally.runs}, steps {tally.steps}, {elapsed:.0f} s; requests admitted "
          f"{tally.admitted}, refused a try {tally.refused}")
    print(f"over-committed steps {tally.overcommitted}, steps with a paused request "
          f"{tally.paused_steps}, heads seated from the line {tally.heads_from_line}, "
          f"seats refused {tally.seats_refused}, most steps one request sat out in a row "
          f"{tally.worst_sat_out}")
    for failure in tally.failures:
        print(f"safe_progress: FAILED: {failure}", file=sys.stderr)
    return 1 if tally.failures else 0


if __name__ == "__main__":
    sys.exit(main())
