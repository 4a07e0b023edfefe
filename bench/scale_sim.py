"""Scale-out policies, simulated: routing and autoscaling over replicas that each run
kvledger's real ``Admission`` and ``KVLedger`` on a virtual clock.

There is no cluster here, so the engines are modelled and the admission is not: every
429 and every Retry-After comes from ``Admission`` (``early_rejection``, ``effective_cap``,
``line_up`` with ``max_queue_wait_s=0``), which reserves prompt + cap in a ``KVLedger`` of
``--pool-blocks`` blocks; finished requests are released and ``done``; decode progress is
reported with ``progress`` and physical blocks drawn with ``grow``, as the server does.
Four policies run on the same seeded trace:

- ``fixed, round-robin``:     ``--replicas`` replicas, requests routed in turn;
- ``fixed, least-reserved``:  to the replica with the lowest reserved ratio (what
  ``kvledger_kv_reserved_ratio`` exposes);
- ``HPA on reserved ratio``:  least-reserved routing, and Kubernetes' HPA algorithm on the
  average reserved ratio of ready replicas (``--target``);
- ``HPA on KV used ratio``:   the same, on used KV blocks / pool (``--used-target``): what
  vLLM's kv_cache_usage or a utilisation metric shows, which counts what is held now,
  not what is promised.

Modelled:

- traffic: Poisson arrivals at ``--rate`` req/s, with bursts of 60-180 s at about
  ``--burst-factor`` times that every 4-8 minutes; 60% chats (prompt ~600 tokens, cap
  256-1024, ~200 tokens written), 25% long generations (cap 2048/4096, 50-100% of it
  written), 15% with ``max_tokens`` unset (cap = the rest of the 8192-token context,
  ~400 written). Requests stop at their own length (EOS), usually well before the cap;
- an engine: at most ``--max-num-seqs`` sequences in slots, admitted requests waiting
  FIFO for one; prefill of the prompt at PREFILL_TOKENS_PER_S, one prompt at a time;
  then every decoding sequence gets one token per step of STEP_BASE_S + STEP_PER_SEQ_S
  per decoding sequence (a fluid model: all advance at that rate between events);
- clients: a 429 is retried after its ``retry-after-ms``, through the router again, at
  most ``--max-retries`` times, then the request is given up;
- the HPA (every 15 s): desired = ceil(current * average / target), 10% tolerance, pods
  still starting count as 0 when scaling up and as the target when scaling down, scale-up
  at most max(2x, +4) per period, scale-down to the highest recommendation of the last
  5 minutes, within ``--replicas``..``--max-replicas``; the HPA reads the gauges of
  ready replicas (used blocks: prompt + tokens written so far of the requests in a slot);
  the fixed replicas and the HPA's minimum serve from the start, a new replica after
  ``--startup-s`` (model load) and costs from its creation; the ReplicaSet removes
  starting pods first, then the newest; a removed replica drains: no new requests, gone
  once its admitted requests finish (none is cut short).

Not modelled: prefill slowing decode (chunked prefill) and batched prefill; preemption,
prefix caching, speculative decoding; network and router latency; the metrics pipeline's
delay (the HPA reads the gauges at the instant it evaluates; a real Prometheus adapter
adds 15-60 s); node provisioning (a GPU is assumed free for each new pod); client
timeouts other than the retry limit; a measured decode rate (``Admission`` reads the
model's current per-sequence rate). Goodput is completions within the trace over its
length; requests still running or retrying at its end count as unfinished.

    .venv/bin/python bench/scale_sim.py            # ~5 s on 2 CPU cores
    .venv/bin/python bench/scale_sim.py --seed 3 --json
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import math
import random
import statistics
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field

from kvledger.engine.admission.line import Admission, Ticket
from kvledger.engine.errors import KVCacheFull
from kvledger.engine.kv.ledger import KVLedger
from kvledger.engine.server.api_errors import retry_headers

MAX_MODEL_LEN = 8192
BLOCK_SIZE = 16
STEP_BASE_S = 0.015            # one decode step with a single sequence
STEP_PER_SEQ_S = 0.00025       # added per decoding sequence
PREFILL_TOKENS_PER_S = 8000.0
HPA_PERIOD_S = 15.0
HPA_TOLERANCE = 0.1
SCALE_DOWN_WINDOW_S = 300.0


@dataclass(frozen=True)
class Request:
    id: int
    arrival_s: float
    prompt_tokens: int
    max_tokens: int | None     # None: unset, the cap is the rest of the context
    output_tokens: int         # written before EOS; never more than the cap


@dataclass(frozen=True)
class Policy:
    name: str
    route: str                 # "round-robin" or "least-reserved"
    scale_on: str | None       # None (fixed), "reserved" or "used"


POLICIES = (Policy("fixed, round-robin", "round-robin", None),
            Policy("fixed, least-reserved", "least-reserved", None),
            Policy("HPA on reserved ratio", "least-reserved", "reserved"),
            Policy("HPA on KV used ratio", "least-reserved", "used"))


# -- the trace ----------------------------------------------------------------------------
def make_bursts(rng: random.Random, end_s: float, factor: float) -> list[tuple[float, float, float]]:
    """(start s, end s, rate multiplier) of each burst."""
    bursts, start_s = [], rng.uniform(120, 300)
    while start_s < end_s:
        length_s = rng.uniform(60, 180)
        bursts.append((start_s, start_s + length_s, factor * rng.uniform(0.75, 1.25)))
        start_s += length_s + rng.uniform(240, 480)
    return bursts


def draw_request(rng: random.Random, request_id: int, arrival_s: float) -> Request:
    def lognormal(median: float, sigma: float, low: int, high: int) -> int:
        return int(min(max(median * math.exp(rng.gauss(0, sigma)), low), high))

    kind = rng.random()
    if kind < 0.60:    # chat
        prompt = lognormal(600, 0.8, 16, 4096)
        cap = rng.choice((256, 512, 1024))
        output = min(cap, lognormal(200, 0.7, 1, cap))
    elif kind < 0.85:  # long generation, runs most of its cap
        prompt = lognormal(1000, 0.6, 16, 4096)
        cap = rng.choice((2048, 4096))
        output = int(cap * rng.uniform(0.5, 1.0))
    else:              # max_tokens unset
        prompt = lognormal(800, 0.8, 16, 4096)
        cap = None
        output = lognormal(400, 0.9, 1, MAX_MODEL_LEN - prompt)
    return Request(request_id, arrival_s, prompt, cap, output)


def make_trace(seed: int, minutes: float, rate: float,
               burst_factor: float) -> tuple[list[Request], list[tuple[float, float, float]]]:
    """Seeded arrivals (thinning of a Poisson process at the peak rate) and the bursts."""
    rng = random.Random(seed)
    end_s = minutes * 60
    bursts = make_bursts(rng, end_s, burst_factor)
    peak = rate * max([1.0] + [f for _, _, f in bursts])
    requests, now_s = [], 0.0
    while (now_s := now_s + rng.expovariate(peak)) < end_s:
        factor = next((f for start, end, f in bursts if start <= now_s < end), 1.0)
        if rng.random() < rate * factor / peak:
            requests.append(draw_request(rng, len(requests), now_s))
    return requests, bursts


# -- the simulation -----------------------------------------------------------------------
class Sim:
    """A discrete-event clock: callbacks run in time order, ties in the order scheduled."""

    def __init__(self) -> None:
        self.now = 0.0
        self._events: list = []
        self._order = itertools.count()

    def at(self, time_s: float, callback, *args) -> None:
        heapq.heappush(self._events, (time_s, next(self._order), callback, args))

    def run_until(self, end_s: float) -> None:
        while self._events and self._events[0][0] <= end_s:
            self.now, _, callback, args = heapq.heappop(self._events)
            callback(*args)
        self.now = end_s


@dataclass(eq=False)
class Job:
    """A request as its client sees it: the 429s it has retried so far."""

    request: Request
    retries: int = 0


@dataclass(eq=False)
class Sequence:
    """An admitted request inside a replica's engine."""

    job: Job
    ticket: Ticket
    start_clock_tokens: float | None = None  # decode clock when decoding began


def admit_now(admission: Admission, request_id: str, prompt_tokens: int, cap_tokens: int) -> Ticket:
    """``Admission.line_up`` without an event loop: with ``max_queue_wait_s=0`` nobody joins
    the line, so it reserves at once or raises KVCacheFull (the server's 429)."""
    granted: Future[Ticket] = Future()
    admission.line_up(request_id, prompt_tokens, cap_tokens, granted)
    return granted.result(timeout=0)


class Replica:
    """One serving replica: the real Admission and KVLedger, and a fluid model of its engine.

    All decoding sequences advance at ``decode_tokens_per_s``; ``_clock_tokens`` integrates
    that rate, so a sequence that starts decoding at clock c with o tokens to write
    finishes when the clock reaches c + o.
    """

    def __init__(self, sim: Sim, args, rng: random.Random, ready_s: float, on_finished) -> None:
        self.sim = sim
        self.max_num_seqs = args.max_num_seqs
        self.ledger = KVLedger(args.pool_blocks, BLOCK_SIZE)
        self.admission = Admission(self.ledger, max_model_len=MAX_MODEL_LEN,
                                   max_num_seqs=args.max_num_seqs,
                                   decode_tokens_per_s=self.decode_tokens_per_s, rng=rng,
                                   clock=lambda: sim.now)
        self.created_s, self.ready_s = sim.now, ready_s
        self.removed_s: float | None = None
        self.draining = False
        self._on_finished = on_finished
        self._queue: deque[Sequence] = deque()  # admitted, waiting for a slot
        self._in_slot: dict[str, Sequence] = {}  # prefilling or decoding
        self._due: list = []                     # heap: (clock at finish, id, Sequence)
        self._clock_tokens = 0.0
        self._clock_at_s = sim.now
        self._version = 0                        # stale finish events are skipped
        self._prefill_free_s = 0.0

    def decode_tokens_per_s(self) -> float:
        return 1.0 / (STEP_BASE_S + STEP_PER_SEQ_S * max(len(self._due), 1))

    def reserved_ratio(self) -> float:
        return self.ledger.reserved_blocks / self.ledger.num_blocks

    def used_ratio(self) -> float:
        self._observe()
        return self.ledger.used_blocks / self.ledger.num_blocks

    def try_admit(self, job: Job) -> float | None:
        """Admit ``job`` (None), or the seconds its 429 told the client to wait."""
        request = job.request
        self._observe()
        early = self.admission.early_rejection(request.prompt_tokens, request.max_tokens)
        try:
            if early is not None:
                raise early
            cap = self.admission.effective_cap(request.prompt_tokens, request.max_tokens)
            ticket = admit_now(self.admission, str(request.id), request.prompt_tokens, cap)
        except KVCacheFull as error:  # the trace fits the context and the pool: nothing else
            return int(retry_headers(error.wait_s)["retry-after-ms"]) / 1000
        self._queue.append(Sequence(job, ticket))
        self._fill_slots()
        return None

    def drain(self) -> None:
        self.draining = True
        self._remove_if_idle()

    # -- the engine model -------------------------------------------------------------
    def _advance(self) -> None:
        """Bring the decode clock to now (before the number of decoding sequences changes)."""
        self._clock_tokens += (self.sim.now - self._clock_at_s) * self.decode_tokens_per_s()
        self._clock_at_s = self.sim.now

    def _generated(self, sequence: Sequence) -> int:
        if sequence.start_clock_tokens is None:
            return 0
        return min(int(self._clock_tokens - sequence.start_clock_tokens),
                   sequence.job.request.output_tokens)

    def _observe(self) -> None:
        """What the server knows now: progress per ticket, physical blocks per reservation."""
        self._advance()
        for sequence in self._in_slot.values():
            generated = self._generated(sequence)
            self.admission.progress(sequence.ticket, generated)
            self.ledger.grow(sequence.ticket.reservation,
                             sequence.job.request.prompt_tokens + generated)

    def _fill_slots(self) -> None:
        while self._queue and len(self._in_slot) < self.max_num_seqs:
            sequence = self._queue.popleft()
            self._in_slot[sequence.ticket.request_id] = sequence
            start_s = max(self.sim.now, self._prefill_free_s)
            self._prefill_free_s = start_s + sequence.job.request.prompt_tokens / PREFILL_TOKENS_PER_S
            self.sim.at(self._prefill_free_s, self._start_decoding, sequence)

    def _start_decoding(self, sequence: Sequence) -> None:
        self._advance()
        sequence.start_clock_tokens = self._clock_tokens
        finish = self._clock_tokens + sequence.job.request.output_tokens
        heapq.heappush(self._due, (finish, sequence.job.request.id, sequence))
        self._schedule_next_finish()

    def _schedule_next_finish(self) -> None:
        self._version += 1
        if self._due:
            wait_s = (self._due[0][0] - self._clock_tokens) / self.decode_tokens_per_s()
            self.sim.at(self.sim.now + max(wait_s, 0.0), self._finish_due, self._version)

    def _finish_due(self, version: int) -> None:
        if version != self._version:
            return
        self._advance()
        while self._due and self._due[0][0] <= self._clock_tokens + 1e-6:
            _, _, sequence = heapq.heappop(self._due)
            self._finish(sequence)
        self._fill_slots()
        self._schedule_next_finish()
        self._remove_if_idle()

    def _finish(self, sequence: Sequence) -> None:
        del self._in_slot[sequence.ticket.request_id]
        for reservation in sequence.ticket.reservations:  # the engine releases, as in serving
            self.ledger.release(reservation)
        self.admission.done(sequence.ticket)
        self._on_finished(sequence.job)

    def _remove_if_idle(self) -> None:
        if self.draining and self.removed_s is None and not self.admission.running:
            self.removed_s = self.sim.now


def hpa_recommendation(current: int, ready_metrics: list[float], starting: int,
                       target: float) -> int:
    """Kubernetes HPA's replica count for an averaged per-pod metric: ceil(current * average
    / target), unchanged within the tolerance; pods still starting have no metric and count
    as 0 when scaling up, as the target when scaling down (unchanged if that flips it)."""
    if not ready_metrics:
        return current
    ratio = statistics.fmean(ready_metrics) / target
    if abs(ratio - 1) <= HPA_TOLERANCE:
        return current
    filled = sum(ready_metrics) + starting * (0.0 if ratio > 1 else target)
    pods = len(ready_metrics) + starting
    new_ratio = filled / pods / target
    if abs(new_ratio - 1) <= HPA_TOLERANCE or (new_ratio > 1) != (ratio > 1):
        return current
    return math.ceil(new_ratio * pods)


@dataclass
class Outcome:
    policy: str
    arrived: int = 0
    completed: int = 0
    gave_up: int = 0
    rejected_429: int = 0
    output_tokens: int = 0
    latencies_s: list[float] = field(default_factory=list)
    first_scale_up_s: float | None = None
    peak_replicas: int = 0
    samples: list[tuple[float, int, float, float]] = field(default_factory=list)
    replica_minutes: float = 0.0


class Cluster:
    """One policy's run: replicas, the router, the clients' retries, maybe the autoscaler."""

    def __init__(self, sim: Sim, policy: Policy, args) -> None:
        self.sim, self.policy, self.args = sim, policy, args
        self.replicas: list[Replica] = []
        self.outcome = Outcome(policy.name)
        self._turn = itertools.count()
        self._recommendations: deque[tuple[float, int]] = deque()
        for _ in range(args.replicas):
            self._add_replica(ready_s=0.0)
        sim.at(HPA_PERIOD_S, self._evaluate)

    def serving(self) -> list[Replica]:
        return [r for r in self.replicas if r.removed_s is None and not r.draining]

    def arrive(self, job: Job) -> None:
        self.outcome.arrived += 1
        self.send(job)

    def send(self, job: Job) -> None:
        retry_after_s = self._route().try_admit(job)
        if retry_after_s is None:
            return
        self.outcome.rejected_429 += 1
        if job.retries >= self.args.max_retries:
            self.outcome.gave_up += 1
            return
        job.retries += 1
        self.sim.at(self.sim.now + retry_after_s, self.send, job)

    def _route(self) -> Replica:
        ready = [r for r in self.serving() if r.ready_s <= self.sim.now]
        if self.policy.route == "round-robin":
            return ready[next(self._turn) % len(ready)]
        return min(ready, key=Replica.reserved_ratio)

    def _finished(self, job: Job) -> None:
        self.outcome.completed += 1
        self.outcome.output_tokens += job.request.output_tokens
        self.outcome.latencies_s.append(self.sim.now - job.request.arrival_s)

    def _add_replica(self, ready_s: float) -> None:
        rng = random.Random(self.args.seed * 1000 + len(self.replicas))
        self.replicas.append(Replica(self.sim, self.args, rng, ready_s, self._finished))
        live = sum(r.removed_s is None for r in self.replicas)
        self.outcome.peak_replicas = max(self.outcome.peak_replicas, live)

    def _evaluate(self) -> None:
        """Every HPA period: sample the gauges of ready replicas; autoscale on one of them."""
        now = self.sim.now
        serving = self.serving()
        ready = [r for r in serving if r.ready_s <= now]
        reserved = [r.reserved_ratio() for r in ready]
        used = [r.used_ratio() for r in ready]
        live = sum(r.removed_s is None for r in self.replicas)
        self.outcome.samples.append((now, live, statistics.fmean(reserved), statistics.fmean(used)))
        if self.policy.scale_on == "reserved":
            self._scale(serving, reserved, self.args.target)
        elif self.policy.scale_on == "used":
            self._scale(serving, used, self.args.used_target)
        self.sim.at(now + HPA_PERIOD_S, self._evaluate)

    def _scale(self, serving: list[Replica], metrics: list[float], target: float) -> None:
        now, current = self.sim.now, len(serving)
        recommendation = hpa_recommendation(current, metrics, current - len(metrics), target)
        self._recommendations.append((now, recommendation))
        while self._recommendations[0][0] < now - SCALE_DOWN_WINDOW_S:
            self._recommendations.popleft()
        desired = (recommendation if recommendation > current
                   else min(current, max(r for _, r in self._recommendations)))
        desired = min(desired, max(2 * current, current + 4))  # HPA's default scale-up limit
        desired = max(self.args.replicas, min(self.args.max_replicas, desired))
        for _ in range(desired - current):
            self._add_replica(ready_s=now + self.args.startup_s)
            if self.outcome.first_scale_up_s is None:
                self.outcome.first_scale_up_s = now
        # The ReplicaSet removes pods not yet ready first, then the newest.
        by_removal_order = sorted(serving, key=lambda r: (r.ready_s <= now, -r.created_s))
        for replica in by_removal_order[:max(current - desired, 0)]:
            replica.drain()


def run_policy(policy: Policy, trace: list[Request], args) -> Outcome:
    sim = Sim()
    cluster = Cluster(sim, policy, args)
    for request in trace:
        sim.at(request.arrival_s, cluster.arrive, Job(request))
    end_s = args.minutes * 60
    sim.run_until(end_s)
    cluster.outcome.replica_minutes = sum(
        (min(r.removed_s if r.removed_s is not None else end_s, end_s) - r.created_s) / 60
        for r in cluster.replicas)
    return cluster.outcome


# -- the report ---------------------------------------------------------------------------
def summarise(outcome: Outcome, minutes: float) -> dict:
    latencies = sorted(outcome.latencies_s)
    p99 = statistics.quantiles(latencies, n=100)[98] if len(latencies) > 1 else None
    samples = outcome.samples
    return {
        "policy": outcome.policy,
        "arrived": outcome.arrived,
        "completed": outcome.completed,
        "gave_up": outcome.gave_up,
        "unfinished": outcome.arrived - outcome.completed - outcome.gave_up,
        "rejected_429": outcome.rejected_429,
        "completed_per_s": outcome.completed / (minutes * 60),
        "output_tokens_per_s": outcome.output_tokens / (minutes * 60),
        "p50_latency_s": statistics.median(latencies) if latencies else None,
        "p99_latency_s": p99,
        "replica_minutes": outcome.replica_minutes,
        "peak_replicas": outcome.peak_replicas,
        "first_scale_up_s": outcome.first_scale_up_s,
        "mean_reserved_ratio": statistics.fmean(s[2] for s in samples) if samples else None,
        "mean_used_ratio": statistics.fmean(s[3] for s in samples) if samples else None,
        "replicas_every_15s": [s[1] for s in samples],
    }


def cell(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_report(args, bursts, trace: list[Request], rows: list[dict], wall_s: float) -> None:
    spans = ", ".join(f"{a / 60:.1f}-{b / 60:.1f} min x{f:.1f}" for a, b, f in bursts)
    print(f"{args.minutes:g} simulated minutes, seed {args.seed}: {len(trace)} requests at "
          f"{args.rate:g} req/s, bursts {spans or 'none'}; replica: {args.pool_blocks} KV "
          f"blocks x {BLOCK_SIZE} tokens, context {MAX_MODEL_LEN}, max {args.max_num_seqs} "
          f"seqs, ready {args.startup_s:g} s after creation; HPA {args.replicas}-"
          f"{args.max_replicas} replicas, target {args.target:g} (reserved) / "
          f"{args.used_target:g} (used); clients retry a 429 up to {args.max_retries} times\n")
    print("| policy | completed | gave up | unfinished | 429s | req/s | output tok/s | p50 s "
          "| p99 s | replica-min | peak replicas | first scale-up s | mean reserved | mean used |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['policy']} | {r['completed']} | {r['gave_up']} | {r['unfinished']} | "
              f"{r['rejected_429']} | {r['completed_per_s']:.2f} | "
              f"{r['output_tokens_per_s']:.0f} | {cell(r['p50_latency_s'], '.1f')} | "
              f"{cell(r['p99_latency_s'], '.1f')} | {r['replica_minutes']:.0f} | "
              f"{r['peak_replicas']} | {cell(r['first_scale_up_s'], '.0f')} | "
              f"{cell(r['mean_reserved_ratio'], '.2f')} | {cell(r['mean_used_ratio'], '.2f')} |")
    base = rows[0]
    print()
    for r in rows[1:]:
        print(f"{r['policy']} / {base['policy']}: "
              f"{ratio(r['output_tokens_per_s'], base['output_tokens_per_s'])} output tok/s, "
              f"{ratio(r['replica_minutes'], base['replica_minutes'])} replica-minutes, "
              f"{ratio(efficiency(r), efficiency(base))} output tokens per replica-minute")
    print(f"\nsimulated in {wall_s:.1f} s")


def ratio(value: float, baseline: float) -> str:
    return f"{value / baseline:.2f}x" if baseline else "-"


def efficiency(row: dict) -> float:
    return row["output_tokens_per_s"] / row["replica_minutes"] if row["replica_minutes"] else 0.0


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--minutes", type=float, default=25.0, help="simulated trace length")
    parser.add_argument("--rate", type=float, default=2.5, help="base arrivals per second")
    parser.add_argument("--burst-factor", type=float, default=4.0,
                        help="rate multiplier in a burst (each drawn within +-25%%)")
    parser.add_argument("--replicas", type=int, default=3,
                        help="replicas of the fixed policies; the HPA's minimum")
    parser.add_argument("--max-replicas", type=int, default=12, help="the HPA's maximum")
    parser.add_argument("--target", type=float, default=0.7,
                        help="HPA target of the average reserved ratio")
    parser.add_argument("--used-target", type=float, default=None,
                        help="HPA target of the average KV used ratio (default: --target)")
    parser.add_argument("--startup-s", type=float, default=75.0,
                        help="a new replica's model load before it serves")
    parser.add_argument("--max-retries", type=int, default=5,
                        help="a client retries a 429 this often, then gives up")
    parser.add_argument("--pool-blocks", type=int, default=8192,
                        help=f"KV blocks of {BLOCK_SIZE} tokens per replica")
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args()
    args.used_target = args.target if args.used_target is None else args.used_target
    if args.minutes <= 0 or args.rate <= 0 or args.burst_factor < 1:
        parser.error("--minutes and --rate must be > 0 and --burst-factor >= 1")
    if not 1 <= args.replicas <= args.max_replicas:
        parser.error("need 1 <= --replicas <= --max-replicas")
    if not (0 < args.target <= 1 and 0 < args.used_target <= 1):
        parser.error("--target and --used-target must be in (0, 1]")
    if args.max_retries < 0 or args.startup_s < 0 or args.max_num_seqs < 1:
        parser.error("--max-retries and --startup-s must be >= 0, --max-num-seqs >= 1")
    if args.pool_blocks * BLOCK_SIZE < MAX_MODEL_LEN:
        parser.error(f"--pool-blocks must hold one full context ({MAX_MODEL_LEN // BLOCK_SIZE})")
    return args


def main() -> None:
    args = parse_args()
    started = time.perf_counter()
    trace, bursts = make_trace(args.seed, args.minutes, args.rate, args.burst_factor)
    rows = [summarise(run_policy(policy, trace, args), args.minutes) for policy in POLICIES]
    wall_s = time.perf_counter() - started
    if args.json:
        print(json.dumps({"config": vars(args), "requests": len(trace),
                          "bursts": [list(b) for b in bursts], "policies": rows,
                          "wall_s": wall_s}))
        return
    print_report(args, bursts, trace, rows, wall_s)


if __name__ == "__main__":
    main()
