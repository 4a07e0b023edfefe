"""Tenants and priorities against vLLM: a flooding API key beside a light one (where the KV
blocks run out first, and where the seats do), and a best-effort flood beside urgent
requests, on ``kvledger serve`` and ``vllm serve`` over HTTP, the same model and flags,
measured in the same run on this machine.

    .venv/bin/python bench/tenants.py [--quick] [--vllm PATH] [--rounds 2]
        [--window-seconds 90] [--clients 24] [--idle-requests 10] [--service-requests 3]
        [--period-seconds 2] [--pool-blocks 32] [--deadline-seconds 300] [--seed 0]
        [--plain-priority-too | --no-plain-priority-too] [--device auto] [--json]
    # workloads 1 and 2: full ~25 min with vLLM on this 2-core machine when nothing else
    # runs (--rounds 2 --window-seconds 45: ~15 min); --quick ~3.5 min (1 round of a 15 s
    # window, 12 flood clients, 3 idle requests, 1 service request, the no-headroom
    # server left out); explicit options override --quick's. Workload 3 adds about what
    # workload 1 takes (estimated: ~12 min full, ~2 min --quick; its first --quick runs
    # took 11 min in all, other processes taking 0.5-1.3 cores of the machine)

The workloads' requests (seeded) and servers are defined in bench/tenants_workloads.py.

Servers: bench/serving.py's overload set-up (its helpers, imported from it): the built-in
``small-llama`` (fp32), ``--max-model-len 512 --max-num-seqs 32 --block-size 32
--enforce-eager``, ``--num-gpu-blocks-override 32`` (``--pool-blocks``; 1,024 tokens of
KV: about three flood requests at their largest), everything else at each server's
default; workload 3's servers take ``--max-num-seqs 8`` and a pool of their own (below),
each server's pool checked in its metrics once it is up. Every server of the run is
started first, side by side (idle, none takes CPU), and loaded one at a time, in
A-B-B-A order over ``--rounds`` rounds (round r with seed ``--seed + r``), pooled.
Requests are ``/v1/completions`` with token ids, ``temperature 0``, ``ignore_eos``; a 429
is retried after its ``retry-after-ms`` (else ``Retry-After``), counted, and a request is
given up ``--deadline-seconds`` after its first attempt. Every latency runs from a
request's first attempt to its answer (its first streamed token for TTFT), retries
included. kvledger gets two API keys, one per tenant; vLLM takes one key at most, so it
runs without one (the clients send theirs anyway).

The flood (every workload): ``--clients`` closed-loop clients, prompts of 64-128 tokens,
``max_tokens`` drawn from 128/192/256, seeded per client. It starts ``RAMP_S`` (5 s)
before the window, so the pool is full and the line long when the window opens, and keeps
going until the window's last light or urgent request is answered; then kvledger's flood
requests are cancelled (the server aborts them), and vLLM's run to their end (no new
ones), so that every token vLLM fed is in the counters its recomputed-token estimate
reads (``vllm_recomputed_tokens``; a request aborted mid-step would count as recomputed).
Nothing after the window is measured; the next server is loaded once this one is idle
(nothing running or waiting, and on kvledger every block given back: the aborted
requests' clean-up takes a moment of CPU after they leave the running gauge).

- Workload 1, two tenants. Key A floods; key B is light: one request every ~2 s (seeded
  gaps of 1-3 s) through the window, a 16-token prompt, ``max_tokens 16``. Measured: the
  light requests' latency p50/p99 under the flood; their idle latency (the same shape,
  ``--idle-requests`` sent one at a time to the idle server before each round's flood);
  the flood's goodput (output tokens of its requests completed within the window, per
  second) and 429s; the most light requests in flight at once (above 1 under fair
  queuing, the light tenant sent faster than its share of admissions and waited behind
  its own requests too: the line alternates between waiting keys, one request each, so
  "light" means well under half the admissions the flood gets, which on a machine that
  other processes slow it may not be; ``--period-seconds`` spaces them). Systems:
  kvledger ``--no-tenant-fairness`` (arrival order; shown), kvledger (fair share between
  keys, the default; judged) and vLLM (its default fcfs).
  **One request's service time** is the median latency of a flood request of the
  flood's median size (96-token prompt, ``max_tokens 192``) sent alone to the idle server,
  ``--service-requests`` of them each round, on kvledger (fair) and on vLLM: the time a
  light request waits at most for one flood request to finish under fair queueing.
- Workload 2, priorities. The flood sends ``priority 10`` (best-effort) under key A;
  urgent requests (key B, ``priority 0``, streamed with ``include_usage``, 16-token
  prompt, ``max_tokens 16``) arrive as the light ones above. Measured: urgent TTFT
  p50/p99 under the flood and idle (``--idle-requests`` alone), urgent latency,
  best-effort goodput (output tokens of best-effort requests completed within the
  window, per second). Systems: kvledger
  ``--scheduling-policy priority --priority-headroom 0.1`` (judged), vLLM
  ``--scheduling-policy priority`` (it preempts running requests for urgent ones and
  recomputes them later), and kvledger ``--scheduling-policy priority`` without headroom
  (``--plain-priority-too``, the default except under ``--quick``; shown, not judged).
- Workload 3, two tenants where the seats run out first: workload 1 (the same requests,
  figures and systems, each its own server) on ``--max-num-seqs 8`` (``SEATS``) and a
  pool that admits every flood request at once at its largest: ``--clients`` x 12
  blocks + 16 for the light requests (304 blocks for 24 clients, 160 for 12), on
  kvledger and vLLM alike. The flood's requests beyond the 8 running wait for a seat, not
  for blocks: in kvledger's seat line (fair share between keys, or arrival order under
  ``--no-tenant-fairness``), in vLLM's waiting queue (fcfs). The time kvledger's requests
  waited for KV blocks (``kvledger_queue_wait_seconds_sum``, every workload's table)
  shows it: about 0 here. One request's service time is measured alone on this
  workload's kvledger (fair) and vLLM servers. The flood's clients start spread over the
  first half of a longer ramp (``SEATS_RAMP_S``, 30 s) before the window: the seats'
  first holders would otherwise all start together, and none end before the shortest of
  them, whatever the order of the line (nothing is preempted); the window then sees a
  flood whose requests end out of step, as one that has run a while.

Preemptions: ``vllm:num_preemptions_total`` on every server (kvledger exports it at 0: it
never preempts, so it never recomputes); vLLM's recomputed tokens from its iteration log
and counters (bench/serving.py's ``vllm_recomputed_tokens``). The CPU that other
processes used during each window is shown (``OtherCpu``): kvledger's decode slows
several times over when anything else takes a core.

Claims (exit 1, one ``tenants: FAILED:`` line each, when one fails):

1. workload 1: kvledger (fair)'s light p99 <= 2 x its idle light p99 + one request's
   service time (above), both measured on that server;
2. workload 1: every kvledger server preempts nothing (``vllm:num_preemptions_total`` 0),
   so nothing is recomputed;
3. workload 1: no light request of kvledger (fair) past the deadline, no 5xx or
   ``kvledger_requests_failed_total``, ``kvledger_kv_blocks_reserved`` back at 0 once
   idle (after its last round, the flood's requests aborted);
4. workload 2: kvledger with headroom: urgent p99 TTFT <= vLLM's plus
   ``TTFT_NOISE_MARGIN`` (10%: twice bench/serving.py's 5% tok/s margin, since a p99 of
   tens of samples moves more than a mean rate on this shared machine);
5. workload 2: kvledger with headroom: best-effort goodput >= 0.9 x vLLM's;
6. workload 2: every kvledger server preempts nothing, so recomputes nothing;
7. workload 2: as 3, for kvledger with headroom's urgent requests;
8-10. workload 3: as 1-3, on its servers (the bound from the idle p99 and the service
   time measured on its kvledger (fair) server).

Without vLLM (``--vllm``, else ``vllm`` on PATH, else a ``vllm-venv`` next to this
repository) the kvledger side runs alone, one line says so, and claims 4 and 5 are not
judged.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from local_server import free_port, wait_ready
from serving import (
    FALLBACK_RETRY_S,
    KVLEDGER,
    MAX_NUM_SEQS,
    MODEL,
    START_TIMEOUT_S,
    BenchError,
    OtherCpu,
    Outcome,
    Server,
    complete,
    iteration_tokens,
    metric,
    percentile,
    retry_delay_s,
    round_order,
    run_and_judge,
    running,
    scrape,
    server_command,
    vllm_recomputed_tokens,
    wait_up,
)
from tenants_workloads import (
    BEST_EFFORT_PRIORITY,
    FAIR,
    FLOOD_MAX_TOKENS,
    FLOOD_PROMPT_TOKENS,
    HEADROOM,
    HEADROOM_SYS,
    KEYS,
    LABELS,
    MIN_POOL_BLOCKS,
    PERIOD_S,
    POOL_BLOCKS,
    RAMP_S,
    SEATS,
    SEATS_FAIR,
    SERVICE_TIMED,
    SMALL_MAX_TOKENS,
    SMALL_PROMPT_TOKENS,
    URGENT_PRIORITY,
    VLLM_PRIORITY,
    System,
    arrival_offsets,
    flood_requests,
    idle_shapes,
    seats_pool_blocks,
    service_shapes,
    small_prompts,
    systems_of,
)

TTFT_NOISE_MARGIN = 0.10
GOODPUT_SHARE = 0.9
LIGHT_BOUND_IDLE_FACTOR = 2
BUSY_MACHINE_CORES = 0.1     # other processes' CPU in a window above which a note is shown

QUICK = {"rounds": 1, "window_seconds": 15.0, "clients": 12, "idle_requests": 3,
         "service_requests": 1, "plain_priority_too": False}
FULL = {"rounds": 2, "window_seconds": 90.0, "clients": 24, "idle_requests": 10,
        "service_requests": 3, "plain_priority_too": True}


# -- requests -------------------------------------------------------------------------

@dataclass
class Request(Outcome):
    """One request, from its first attempt (seconds from the round's start)."""

    kind: str = ""               # flood | light | urgent | idle | service
    first_token_s: float | None = None
    refusals: Counter = field(default_factory=Counter)   # 429s by code


def body_of(model: str, prompt: list[int], max_tokens: int, priority: int | None,
            stream: bool) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}
    if priority is not None:
        body["priority"] = priority
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    return body


def parse_sse_line(line: bytes) -> dict | None:
    """The JSON of one ``data:`` line of a stream; None for other lines and ``[DONE]``."""
    line = line.strip()
    if not line.startswith(b"data:"):
        return None
    data = line[5:].strip()
    return None if data == b"[DONE]" else json.loads(data)


async def stream_completion(session, base: str, body: dict, timeout_s: float,
                            on_first_token) -> tuple[int, dict, object]:
    """(status, headers, the usage of a whole stream else the body's text); calls
    ``on_first_token()`` at the first event that carries a choice."""
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with session.post(base + "/v1/completions", json=body, timeout=timeout) as response:
        if response.status != 200:
            return response.status, response.headers, await response.text()
        usage, seen = None, False
        async for line in response.content:
            event = parse_sse_line(line)
            if event is None:
                continue
            if "error" in event:
                return 500, response.headers, json.dumps(event)
            if event.get("choices") and not seen:
                seen = True
                on_first_token()
            usage = event.get("usage") or usage
        return 200, response.headers, {"usage": usage}


async def send(session, base: str, body: dict, request: Request, start: float,
               deadline_s: float) -> None:
    """``request`` to its answer, its deadline or a failure, 429s retried after their wait."""
    first = start + request.started_s
    deadline = first + deadline_s

    def first_token() -> None:
        request.first_token_s = time.monotonic() - start

    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            request.result = "past_deadline"
            return
        request.attempts += 1
        try:
            if body.get("stream"):
                status, headers, answer = await stream_completion(session, base, body, left,
                                                                  first_token)
            else:
                status, headers, answer = await complete(session, base, body, timeout_s=left)
        except TimeoutError:
            request.result = "past_deadline"
            return
        except (aiohttp.ClientError, json.JSONDecodeError):
            request.result = "server_error"
            return
        if status == 200:
            request.result, request.finished_s = "completed", time.monotonic() - start
            usage = answer["usage"]
            request.output_tokens = usage["completion_tokens"] if usage else 0
            return
        if status != 429:
            request.result = "server_error" if status >= 500 else "refused"
            return
        request.rejected_429 += 1
        request.refusals[refusal_code(answer)] += 1
        delay = retry_delay_s(headers)
        await asyncio.sleep(min(FALLBACK_RETRY_S if delay is None else delay,
                                max(0.0, deadline - time.monotonic())))


def refusal_code(text: str) -> str:
    """A 429 body's error code (``queue_full``, ``tenant_queue_full``, ``kv_cache_full``)."""
    with contextlib.suppress(ValueError, TypeError, KeyError, AttributeError):
        return json.loads(text)["error"]["code"] or "none"
    return "none"


def session_for(key: str) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                 headers={"Authorization": f"Bearer {key}"})


async def one_at_a_time(server: Server, kind: str, shapes: list[tuple[list[int], int]],
                        priority: int | None, stream: bool, deadline_s: float) -> list[Request]:
    """Requests sent alone, each after the one before is answered (idle figures)."""
    out = []
    start = time.monotonic()
    async with session_for(KEYS["small"]) as session:
        for prompt, max_tokens in shapes:
            request = Request(max_tokens, len(prompt), time.monotonic() - start, kind=kind)
            out.append(request)
            await send(session, server.base, body_of(server.model, prompt, max_tokens,
                                                     priority, stream),
                       request, start, deadline_s)
    return out


async def loaded_round(server: Server, system: System, args, seed: int, priority_flood: int | None,
                       small_kind: str, small_priority: int | None, stream: bool,
                       groups: list[int]) -> dict:
    """The flood (closed loop) and the paced light or urgent requests, one round: the
    outcomes, timed from the round's start, the window being [ramp, ramp + window) (the
    system's ``ramp_s``)."""
    start, ramp_s = time.monotonic(), system.ramp_s
    stop = asyncio.Event()
    flood: list[Request] = []
    small: list[Request] = []

    async def flood_client(session, index: int) -> None:
        if system.staggered:
            await asyncio.sleep(index * ramp_s / 2 / args.clients)
        for prompt, max_tokens in flood_requests(seed, index):
            if stop.is_set():
                return
            request = Request(max_tokens, len(prompt), time.monotonic() - start, kind="flood")
            flood.append(request)
            await send(session, server.base, body_of(server.model, prompt, max_tokens,
                                                     priority_flood, False),
                       request, start, args.deadline_seconds)

    async def paced(session) -> None:
        prompts = small_prompts(seed, "loaded")
        tasks = []
        for offset in arrival_offsets(seed, args.window_seconds, args.period_seconds):
            await asyncio.sleep(max(0.0, start + ramp_s + offset - time.monotonic()))
            request = Request(SMALL_MAX_TOKENS, SMALL_PROMPT_TOKENS,
                              time.monotonic() - start, kind=small_kind)
            small.append(request)
            tasks.append(asyncio.create_task(send(
                session, server.base, body_of(server.model, next(prompts), SMALL_MAX_TOKENS,
                                              small_priority, stream),
                request, start, args.deadline_seconds)))
        await asyncio.gather(*tasks)

    async with session_for(KEYS["flood"]) as flood_session, \
            session_for(KEYS["small"]) as small_session:
        clients = [asyncio.create_task(flood_client(flood_session, i))
                   for i in range(args.clients)]
        with OtherCpu(groups) as other:
            await paced(small_session)
        stop.set()
        if system.engine == "vllm":       # every token it fed ends in its counters
            await asyncio.gather(*clients)
        else:                             # the server aborts what the clients leave
            for task in clients:
                task.cancel()
            await asyncio.gather(*clients, return_exceptions=True)
    for request in flood:
        if request.result == "running":
            request.result = "cancelled"
    return {"flood": flood, "small": small, "other_cpu_cores": other.cores}


# -- summaries and claims ---------------------------------------------------------------

def latencies(requests: list[Request], to_first_token: bool = False) -> list[float]:
    """Seconds from first attempt to the answer (or to the first token) of each completed
    request."""
    return [(r.first_token_s if to_first_token else r.finished_s) - r.started_s
            for r in requests if r.result == "completed"
            and (r.first_token_s is not None or not to_first_token)]


def most_in_flight(requests: list[Request]) -> int:
    """The most of ``requests`` (one round's) that were between their first attempt and
    their end at once: above 1, the tenant sent its next request before its last was
    answered (under fair queuing: it sent faster than its share of admissions, and waited
    behind its own requests too). A request with no end (past its deadline, failed)
    counts as never ending."""
    events = sorted([(r.started_s, 1) for r in requests]
                    + [(r.finished_s, -1) for r in requests if r.finished_s is not None],
                    key=lambda e: (e[0], e[1]))   # an end before a start at the same time
    most = now = 0
    for _, step in events:
        now += step
        most = max(most, now)
    return most


def summarize_small(requests: list[Request], ttft: bool = False) -> dict:
    """The light or urgent requests of one server (rounds pooled): latency and, for
    streamed ones, TTFT percentiles; how they ended; their 429s by code."""
    done = latencies(requests)
    out = {"sent": len(requests), "completed": len(done),
           "p50_s": percentile(done, 0.5), "p99_s": percentile(done, 0.99),
           "rejected_429": sum(r.rejected_429 for r in requests),
           "refusals": dict(sum((r.refusals for r in requests), Counter())),
           "attempts_max": max((r.attempts for r in requests), default=None),
           "past_deadline": sum(r.result == "past_deadline" for r in requests),
           "server_errors_5xx": sum(r.result == "server_error" for r in requests),
           "refused_other_4xx": sum(r.result == "refused" for r in requests)}
    if ttft:
        first = latencies(requests, to_first_token=True)
        out |= {"ttft_p50_s": percentile(first, 0.5), "ttft_p99_s": percentile(first, 0.99)}
    return out


def goodput(requests: list[Request], window_s: float, rounds: int = 1,
            ramp_s: float = RAMP_S) -> float:
    """Output tokens per second of the requests completed within the window
    [ramp_s, ramp_s + window_s) of their round, over ``rounds`` windows."""
    tokens = sum(r.output_tokens for r in requests if r.result == "completed"
                 and ramp_s <= r.finished_s < ramp_s + window_s)
    return tokens / (window_s * rounds)


def summarize_flood(requests: list[Request], window_s: float, rounds: int,
                    ramp_s: float = RAMP_S) -> dict:
    return {"sent": len(requests),
            "completed_in_window": sum(r.result == "completed"
                                       and ramp_s <= r.finished_s < ramp_s + window_s
                                       for r in requests),
            "goodput_tok_s": goodput(requests, window_s, rounds, ramp_s),
            "rejected_429": sum(r.rejected_429 for r in requests),
            "refusals": dict(sum((r.refusals for r in requests), Counter())),
            "server_errors_5xx": sum(r.result == "server_error" for r in requests),
            "refused_other_4xx": sum(r.result == "refused" for r in requests)}


def service_time(requests: list[Request]) -> float | None:
    """One flood request's service time: the median latency of those sent alone."""
    done = latencies(requests)
    return statistics.median(done) if done else None


def light_bound(idle_p99_s: float | None, service_s: float | None) -> float | None:
    """Claim 1's ceiling: 2 x the idle light p99 + one request's service time."""
    if idle_p99_s is None or service_s is None:
        return None
    return LIGHT_BOUND_IDLE_FACTOR * idle_p99_s + service_s


def _s(seconds: float | None, digits: int = 2) -> str:
    return "-" if seconds is None else f"{seconds:.{digits}f} s"


def _claim_no_preemption(claim, workload: str, results: dict) -> None:
    """The claim that no kvledger server of ``results`` preempted (so none recomputed)."""
    kv = {n: r for n, r in results.items() if n.startswith("kvledger")}
    claim(f"{workload}: kvledger preempts nothing, so recomputes nothing "
          "(vllm:num_preemptions_total 0 on each kvledger server)",
          ", ".join(f"{n} {r['server']['preemptions']:g}" for n, r in kv.items()),
          all(r["server"]["preemptions"] == 0 for r in kv.values()))


def _kv_clean(server: dict, small: dict) -> tuple[bool, str]:
    failures = small["server_errors_5xx"] + (server.get("requests_failed") or 0)
    reserved = server.get("blocks_reserved_idle") or 0
    return (failures == 0 and small["refused_other_4xx"] == 0 and small["past_deadline"] == 0
            and reserved == 0,
            f"{small['past_deadline']} past the deadline, {small['server_errors_5xx']} 5xx, "
            f"{small['refused_other_4xx']} other 4xx, {server.get('requests_failed') or 0:g} "
            f"counted failed, {reserved:g} blocks reserved once idle")


def _two_tenant_claims(claim, workload: str, results: dict, fair_name: str) -> None:
    """The claims of a two-tenant workload (1, and 3 on its seats-limited servers): the
    fair server's light p99 within its bound, no kvledger server preempting, the fair
    server's light requests all answered and its blocks all back."""
    fair = results[fair_name]
    bound = light_bound(fair["idle"]["p99_s"], fair["service_s"])
    p99 = fair["light"]["p99_s"]
    claim(f"{workload}: kvledger (fair) light p99 <= 2 x its idle p99 + one flood request's "
          "service time",
          f"{_s(p99)} vs 2 x {_s(fair['idle']['p99_s'])} + {_s(fair['service_s'])} = "
          f"{_s(bound)}", p99 is not None and bound is not None and p99 <= bound)
    _claim_no_preemption(claim, workload, results)
    met, value = _kv_clean(fair["server"], fair["light"])
    claim(f"{workload}: every kvledger (fair) light request answered, no server failure, "
          "every block back once idle", value, met)


def claims(one: dict, two: dict, three: dict) -> list[dict]:
    """Each claim, its measured value and whether it holds: the comparisons with vLLM only
    when vLLM ran (its entries absent otherwise)."""
    out = []

    def claim(text: str, value: str, met: bool) -> None:
        out.append({"claim": text, "measured": value, "met": bool(met)})

    _two_tenant_claims(claim, "workload 1", one, FAIR)
    head = two[HEADROOM_SYS]
    vllm = two.get(VLLM_PRIORITY)
    if vllm is not None:
        kv_p99, vl_p99 = head["urgent"]["ttft_p99_s"], vllm["urgent"]["ttft_p99_s"]
        claim(f"workload 2: kvledger (headroom {HEADROOM}) urgent p99 TTFT <= vLLM's plus "
              f"{TTFT_NOISE_MARGIN:.0%} noise",
              f"{_s(kv_p99, 3)} vs {_s(vl_p99, 3)}",
              kv_p99 is not None and vl_p99 is not None
              and kv_p99 <= vl_p99 * (1 + TTFT_NOISE_MARGIN))
        kv_good, vl_good = head["best_effort"]["goodput_tok_s"], vllm["best_effort"]["goodput_tok_s"]
        claim(f"workload 2: kvledger (headroom {HEADROOM}) best-effort goodput >= "
              f"{GOODPUT_SHARE:g} x vLLM's",
              f"{kv_good:.1f} vs {vl_good:.1f} tok/s"
              + (f" ({kv_good / vl_good:.2f}x)" if vl_good else ""),
              kv_good >= GOODPUT_SHARE * vl_good)
    _claim_no_preemption(claim, "workload 2", two)
    met, value = _kv_clean(head["server"], head["urgent"])
    claim(f"workload 2: every kvledger (headroom {HEADROOM}) urgent request answered, no "
          "server failure, every block back once idle", value, met)
    _two_tenant_claims(claim, "workload 3", three, SEATS_FAIR)
    return out


# -- servers ----------------------------------------------------------------------------

def check_pool(system: System, samples) -> None:
    """That the server runs ``system.pool_blocks`` KV blocks, as its metrics ``samples``
    say (kvledger_kv_blocks_total; vLLM's cache_config_info); else a BenchError."""
    pool = (metric(samples, "kvledger_kv_blocks_total") if system.engine == "kvledger" else
            next((float(labels["num_gpu_blocks"]) for name, labels, _ in samples
                  if name == "vllm:cache_config_info"), None))
    if pool != system.pool_blocks:
        raise BenchError(f"{system.name} runs {pool} KV blocks, not the {system.pool_blocks} "
                         "asked")


@contextlib.asynccontextmanager
async def served(system: System, args, model_dir: str, tmp: Path):
    """A running ``Server`` of ``system``, its pool checked to be ``system.pool_blocks``
    blocks: serving.py's command with the system's seats and ``system.flags`` added (vLLM
    logs each iteration, for its recomputed tokens)."""
    port = free_port()
    command, env = server_command(system.engine, args.vllm, model_dir, port, system.pool_blocks,
                                  iteration_log=system.engine == "vllm", device=args.device,
                                  max_num_seqs=system.max_num_seqs)
    log_path = tmp / f"{system.name}.log"
    base = f"http://127.0.0.1:{port}"
    with running([*command, *system.flags], log_path, env) as proc:
        if system.engine == "kvledger":  # /v1/models wants a key: wait_up cannot ask it
            try:
                model = await wait_ready(base, proc)
            except SystemExit as exc:
                tail = log_path.read_text(errors="replace").splitlines()[-15:]
                raise BenchError(f"{system.name}: {exc}:\n" + "\n".join(tail)) from None
        else:
            model = await wait_up(base, "/health", proc, log_path)
        check_pool(system, await scrape(base))
        yield Server(base, model, log_path, proc.pid)


async def start_all(stack: contextlib.AsyncExitStack, systems: list[System], args,
                    model_dir: str, tmp: Path) -> dict[str, Server]:
    """Every server started at once (their start-ups overlap), each stopped with ``stack``."""
    results = await asyncio.gather(*(stack.enter_async_context(served(s, args, model_dir, tmp))
                                     for s in systems), return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    servers = dict(zip((s.name for s in systems), results, strict=True))
    for system in systems:  # warm-up: both shapes, streamed and not, a few at once
        server = servers[system.name]
        small, large = list(range(10, 10 + SMALL_PROMPT_TOKENS)), list(range(10, 10 + 96))
        bodies = [body_of(server.model, small, SMALL_MAX_TOKENS, None, False)] * 2 + [
            body_of(server.model, small, SMALL_MAX_TOKENS, None, True),
            body_of(server.model, large, 32, None, False)]
        async with session_for(KEYS["small"]) as session:
            results = await asyncio.gather(*(warm_up(session, server.base, body)
                                             for body in bodies))
            results.append(await warm_up(session, server.base, bodies[2]))
        if any(status != 200 for status in results):
            raise BenchError(f"{system.name}: warm-up answered {results}")
    return servers


async def warm_up(session, base: str, body: dict) -> int:
    request = Request(body["max_tokens"], len(body["prompt"]), 0.0, kind="warm-up")
    await send(session, base, body, request, time.monotonic(), START_TIMEOUT_S)
    return 200 if request.result == "completed" else 0


IDLE_GAUGES = {"kvledger": ("kvledger_requests_running", "kvledger_requests_waiting",
                             "kvledger_kv_blocks_reserved"),
               "vllm": ("vllm:num_requests_running", "vllm:num_requests_waiting")}


async def settled(system: System, server: Server, timeout_s: float = 120.0) -> list:
    """The metrics once the server is idle: nothing running or waiting and, on kvledger,
    every block given back (the requests its clients left are aborted a moment after
    they stop running: the next measurement must not share the CPU with that); at most
    ``timeout_s`` later, when they are returned as they are."""
    deadline = time.monotonic() + timeout_s
    while True:
        samples = await scrape(server.base)
        if time.monotonic() >= deadline or not any(
                metric(samples, gauge) for gauge in IDLE_GAUGES[system.engine]):
            return samples
        await asyncio.sleep(0.25)


async def server_figures(system: System, server: Server) -> dict:
    """Its counters once idle (totals since it started, so over every round)."""
    if system.engine == "kvledger":
        samples = await settled(system, server)
        return {"preemptions": metric(samples, "vllm:num_preemptions_total"),
                "recomputed_tokens": 0,
                "requests_failed": metric(samples, "kvledger_requests_failed_total"),
                "requests_rejected": metric(samples, "kvledger_requests_rejected_total"),
                "blocks_reserved_idle": metric(samples, "kvledger_kv_blocks_reserved"),
                "kv_wait_s": metric(samples, "kvledger_queue_wait_seconds_sum")}
    samples = await settled(system, server)
    fed = iteration_tokens(server.log_path.read_text(errors="replace"))
    return {"preemptions": metric(samples, "vllm:num_preemptions_total"),
            "recomputed_tokens": vllm_recomputed_tokens(samples, fed), "tokens_fed": fed,
            "requests_failed": metric(samples, "vllm:request_success_total",
                                      finished_reason="error")}


# -- the workloads ----------------------------------------------------------------------

async def workload(number: int, systems: list[System], servers: dict[str, Server],
                   args) -> dict[str, dict]:
    """Each system's figures of workload ``number`` (1: two tenants, 2: priorities, 3: two
    tenants where the seats run out first: as 1, on other servers)."""
    per = {s.name: {"idle": [], "service": [], "flood": [], "small": [], "rounds": []}
           for s in systems}
    groups = [server.process_group for server in servers.values()]
    two = number == 2
    for index in range(args.rounds):
        seed = args.seed + index
        for system in round_order(systems, index):
            server, mine = servers[system.name], per[system.name]
            mine["idle"] += await one_at_a_time(
                server, "idle", idle_shapes(seed, args.idle_requests),
                URGENT_PRIORITY if two else None, two, args.deadline_seconds)
            if system.name in SERVICE_TIMED:
                mine["service"] += await one_at_a_time(
                    server, "service", service_shapes(seed, args.service_requests), None,
                    False, args.deadline_seconds)
            result = await loaded_round(
                server, system, args, seed,
                BEST_EFFORT_PRIORITY if two else None, "urgent" if two else "light",
                URGENT_PRIORITY if two else None, two, groups)
            await settled(system, server)
            mine["flood"] += result["flood"]
            mine["small"] += result["small"]
            mine["rounds"].append({
                "small": summarize_small(result["small"], ttft=two),
                "small_in_flight_max": most_in_flight(result["small"]),
                "flood_goodput_tok_s": goodput(result["flood"], args.window_seconds, 1,
                                               system.ramp_s),
                "other_cpu_cores": result["other_cpu_cores"]})
    figures = {s.name: await server_figures(s, servers[s.name]) for s in systems}
    out = {}
    for system in systems:
        mine = per[system.name]
        small_key, flood_key = ("urgent", "best_effort") if two else ("light", "flood")
        out[system.name] = {
            "idle": summarize_small(mine["idle"], ttft=two),
            small_key: summarize_small(mine["small"], ttft=two),
            flood_key: summarize_flood(mine["flood"], args.window_seconds, args.rounds,
                                       system.ramp_s),
            "rounds": mine["rounds"],
            "server": figures[system.name],
            "pool_blocks": system.pool_blocks, "max_num_seqs": system.max_num_seqs}
        if not two:
            out[system.name]["service_s"] = service_time(mine["service"])
            out[system.name]["service_n"] = len(latencies(mine["service"]))
    return out


# -- report -----------------------------------------------------------------------------

def _cores(cores: float | None) -> str:
    return "-" if cores is None else f"{cores:.2f}"


def _pair(a: float | None, b: float | None, digits: int = 2) -> str:
    return f"{_s(a, digits)} / {_s(b, digits)}"


def _table(results: dict[str, dict], rows: list[tuple[str, object]]) -> list[str]:
    names = list(results)
    lines = ["| | " + " | ".join(LABELS[n] for n in names) + " |",
             "|---|" + "---:|" * len(names)]
    for label, show in rows:
        lines.append(f"| {label} | " + " | ".join(str(show(results[n])) for n in names) + " |")
    return lines


def _refusals(figures: dict) -> str:
    codes = ", ".join(f"{code} {n}" for code, n in sorted(figures["refusals"].items()))
    return f"{figures['rejected_429']}" + (f" ({codes})" if codes else "")


def _recomputed(r: dict) -> str:
    if r["server"].get("tokens_fed") is None:
        return "0: nothing is preempted"
    return f"{r['server']['recomputed_tokens']}"


def _reserved(r: dict) -> str:
    reserved = r["server"].get("blocks_reserved_idle")
    return "-" if reserved is None else f"{reserved:g}"


def _kv_wait(r: dict) -> str:
    waited = r["server"].get("kv_wait_s")
    return "-" if waited is None else f"{waited:.1f}"


# The last rows of every workload's table: what each server did beside the requests.
_SERVER_ROWS = [
    ("preemptions", lambda r: f"{r['server']['preemptions']:g}"),
    ("recomputed tokens", _recomputed),
    ("kvledger_kv_blocks_reserved once idle", _reserved),
    ("time waited for KV blocks, all requests, s (kvledger_queue_wait_seconds_sum)", _kv_wait),
    ("other processes' CPU in the window, cores (each round)",
     lambda r: " / ".join(_cores(x["other_cpu_cores"]) for x in r["rounds"])),
]


# The rows of the two-tenant workloads' tables (1 and 3), before _SERVER_ROWS.
_TWO_TENANT_ROWS = [
    ("light idle: n, p50 / p99", lambda r: f"{r['idle']['completed']}, "
     + _pair(r["idle"]["p50_s"], r["idle"]["p99_s"])),
    ("light under the flood: completed / sent", lambda r: f"{r['light']['completed']} / "
     f"{r['light']['sent']}"),
    ("light under the flood: p50 / p99", lambda r: _pair(r["light"]["p50_s"],
                                                         r["light"]["p99_s"])),
    ("light p99 of each round", lambda r: " / ".join(_s(x["small"]["p99_s"])
                                                     for x in r["rounds"])),
    ("light requests in flight at once, most (each round)", lambda r: " / ".join(
        str(x["small_in_flight_max"]) for x in r["rounds"])),
    ("light 429s (codes)", lambda r: _refusals(r["light"])),
    ("light past the deadline / 5xx", lambda r: f"{r['light']['past_deadline']} / "
     f"{r['light']['server_errors_5xx']}"),
    ("service time: a 96+192 flood request alone, median (n)",
     lambda r: "-" if r.get("service_s") is None else
     f"{_s(r['service_s'])} ({r['service_n']})"),
    ("bound: 2 x idle p99 + service time", lambda r: _s(light_bound(
        r["idle"]["p99_s"], r.get("service_s")))),
    ("flood: requests completed in the window", lambda r: r["flood"]["completed_in_window"]),
    ("flood goodput, output tok/s", lambda r: f"{r['flood']['goodput_tok_s']:.1f}"),
    ("flood goodput of each round", lambda r: " / ".join(
        f"{x['flood_goodput_tok_s']:.1f}" for x in r["rounds"])),
    ("flood 429s (codes)", lambda r: _refusals(r["flood"])),
]


def tables(report: dict) -> str:
    cfg = report["config"]
    head = (f"{cfg['clients']} flood clients (prompts {FLOOD_PROMPT_TOKENS[0]}-"
            f"{FLOOD_PROMPT_TOKENS[1]} tokens, max_tokens {'/'.join(map(str, FLOOD_MAX_TOKENS))}),"
            f" a {cfg['window_seconds']:g} s window after a {RAMP_S:g} s ramp, {cfg['rounds']} "
            f"round(s) (A-B-B-A) pooled; --max-num-seqs {MAX_NUM_SEQS}, {cfg['pool_blocks']} KV "
            f"blocks of 32; kvledger on {cfg['device']}")
    one, two, three = report["workload1"], report["workload2"], report["workload3"]
    lines = [f"Workload 1, two tenants: {head}. Light tenant: {SMALL_PROMPT_TOKENS}-token "
             f"prompt, max_tokens {SMALL_MAX_TOKENS}, one every ~{cfg['period_seconds']:g} s; "
             "latency from first attempt to answer.", ""]
    lines += _table(one, [*_TWO_TENANT_ROWS, *_SERVER_ROWS])
    lines += ["", f"Workload 2, priorities: {head}; the flood at priority "
              f"{BEST_EFFORT_PRIORITY}. Urgent: priority {URGENT_PRIORITY}, streamed, "
              f"{SMALL_PROMPT_TOKENS}-token prompt, max_tokens {SMALL_MAX_TOKENS}, one every "
              f"~{cfg['period_seconds']:g} s; TTFT from first attempt to the first streamed token.", ""]
    lines += _table(two, [
        ("urgent idle: n, TTFT p50 / p99", lambda r: f"{r['idle']['completed']}, "
         + _pair(r["idle"]["ttft_p50_s"], r["idle"]["ttft_p99_s"], 3)),
        ("urgent under the flood: completed / sent", lambda r: f"{r['urgent']['completed']} / "
         f"{r['urgent']['sent']}"),
        ("urgent TTFT p50 / p99", lambda r: _pair(r["urgent"]["ttft_p50_s"],
                                                  r["urgent"]["ttft_p99_s"], 3)),
        ("urgent TTFT p99 of each round", lambda r: " / ".join(
            _s(x["small"]["ttft_p99_s"], 3) for x in r["rounds"])),
        ("urgent requests in flight at once, most (each round)", lambda r: " / ".join(
            str(x["small_in_flight_max"]) for x in r["rounds"])),
        ("urgent latency p50 / p99", lambda r: _pair(r["urgent"]["p50_s"], r["urgent"]["p99_s"])),
        ("urgent 429s (codes)", lambda r: _refusals(r["urgent"])),
        ("urgent past the deadline / 5xx", lambda r: f"{r['urgent']['past_deadline']} / "
         f"{r['urgent']['server_errors_5xx']}"),
        ("best-effort: completed in the window",
         lambda r: r["best_effort"]["completed_in_window"]),
        ("best-effort goodput, output tok/s", lambda r: f"{r['best_effort']['goodput_tok_s']:.1f}"),
        ("best-effort goodput of each round", lambda r: " / ".join(
            f"{x['flood_goodput_tok_s']:.1f}" for x in r["rounds"])),
        ("best-effort 429s (codes)", lambda r: _refusals(r["best_effort"])),
        *_SERVER_ROWS,
    ])
    lines += ["", f"Workload 3, two tenants where the seats run out first: workload 1 on "
              f"--max-num-seqs {cfg['seats_max_num_seqs']} and {cfg['seats_pool_blocks']} KV "
              "blocks of 32, every flood request at its largest admitted at once: admitted "
              "requests wait for a seat, not for blocks.", ""]
    lines += _table(three, [*_TWO_TENANT_ROWS, *_SERVER_ROWS])
    busiest = max((x["other_cpu_cores"] or 0.0 for w in (one, two, three) for r in w.values()
                   for x in r["rounds"]), default=0.0)
    if busiest > BUSY_MACHINE_CORES:
        lines += ["", f"Note: other processes took up to {busiest:.2f} cores of this machine's "
                  "during a window; kvledger's decode slows several times over when anything "
                  "else takes a core, so such a window measured the machine as much as the "
                  "server."]
    lines.append("")
    for c in report["claims"]:
        lines.append(f"{'met   ' if c['met'] else 'FAILED'}  {c['claim']}: {c['measured']}")
    if not report["vllm_found"]:
        lines.append(f"vLLM not found ({report['vllm_missing']}): kvledger ran alone, the "
                     "comparisons with vLLM not judged")
    return "\n".join(lines)


async def bench(args) -> dict:
    one_systems, two_systems, three_systems = systems_of(
        bool(args.vllm), args.plain_priority_too, args.pool_blocks, args.clients)
    with tempfile.TemporaryDirectory(prefix="kvledger-tenants-") as tmp_name:
        tmp = Path(tmp_name)
        model_dir = str(tmp / MODEL)
        subprocess.run([*KVLEDGER, "make-model", MODEL, model_dir], check=True,
                       stdout=subprocess.DEVNULL)
        async with contextlib.AsyncExitStack() as stack:
            servers = await start_all(stack, one_systems + two_systems + three_systems, args,
                                      model_dir, tmp)
            one = await workload(1, one_systems, servers, args)
            two = await workload(2, two_systems, servers, args)
            three = await workload(3, three_systems, servers, args)
    return {"config": {"device": args.device, "rounds": args.rounds,
                       "window_seconds": args.window_seconds, "clients": args.clients,
                       "idle_requests": args.idle_requests,
                       "service_requests": args.service_requests,
                       "period_seconds": args.period_seconds,
                       "deadline_seconds": args.deadline_seconds, "seed": args.seed,
                       "pool_blocks": args.pool_blocks, "ramp_seconds": RAMP_S,
                       "seats_max_num_seqs": SEATS,
                       "seats_pool_blocks": seats_pool_blocks(args.clients),
                       "ttft_noise_margin": TTFT_NOISE_MARGIN, "goodput_share": GOODPUT_SHARE},
            "vllm_found": bool(args.vllm), "workload1": one, "workload2": two,
            "workload3": three, "claims": claims(one, two, three)}


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--vllm", help="a vllm executable (default: on PATH, else "
                        "../vllm-venv/bin/vllm beside this repository)")
    parser.add_argument("--quick", action="store_true",
                        help="a short run: " + ", ".join(f"{k} {v}" for k, v in QUICK.items()))
    parser.add_argument("--rounds", type=_positive, help=f"A-B-B-A rounds (default {FULL['rounds']})")
    parser.add_argument("--window-seconds", type=float,
                        help=f"each round's measured window (default {FULL['window_seconds']:g})")
    parser.add_argument("--clients", type=_positive,
                        help=f"flood clients (default {FULL['clients']})")
    parser.add_argument("--idle-requests", type=_positive,
                        help=f"idle light / urgent requests a round (default {FULL['idle_requests']})")
    parser.add_argument("--service-requests", type=_positive,
                        help=f"flood requests sent alone a round (default {FULL['service_requests']})")
    parser.add_argument("--plain-priority-too", action=argparse.BooleanOptionalAction,
                        help="workload 2 on kvledger's priority policy without headroom too "
                        "(shown, not judged; default: yes, no under --quick)")
    parser.add_argument("--period-seconds", type=float, default=PERIOD_S,
                        help="the light / urgent requests' mean gap (default %(default)g: "
                        "gaps of 0.5-1.5 x it)")
    parser.add_argument("--pool-blocks", type=_positive, default=POOL_BLOCKS,
                        help="KV blocks of 32 tokens, every server of workloads 1 and 2 "
                        "(default %(default)s, serving.py's overload pool; at least 16; "
                        "workload 3's servers take --clients x 12 + 16)")
    parser.add_argument("--deadline-seconds", type=float, default=300.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                        help="kvledger's device (auto: CUDA when torch sees one, else the CPU)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    if args.pool_blocks < MIN_POOL_BLOCKS:
        parser.error(f"--pool-blocks must be at least {MIN_POOL_BLOCKS} (a 128-token prompt "
                     "with max_tokens 256 takes 12 blocks; kvledger's best-effort requests "
                     "must also fit beside --priority-headroom's share)")
    for name, value in (QUICK if args.quick else FULL).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def main() -> int:
    return run_and_judge("tenants", parse_args(), bench, tables,
                         "kvledger ran alone, the comparisons with vLLM not judged")


if __name__ == "__main__":
    sys.exit(main())
