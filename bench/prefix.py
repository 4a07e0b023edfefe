"""Prefix caching on chat workloads: kvledger with its prefix cache, kvledger without it
(``enable_prefix_caching=False``) and Hugging Face transformers' continuous batching with
block sharing (the ``ContinuousBatchingManager`` that ``generate_batch`` runs), on the same
model, prompts and KV pool, all measured in this run.

    .venv/bin/python bench/prefix.py [--model small-llama] [--requests 24] [--concurrency 8]
        [--output-tokens 32] [--system-prompt-tokens 384] [--turns 4] [--overhead-runs 2]
        [--json]

Three workloads, each a closed loop of at most ``--concurrency`` conversations in flight
(a conversation's next turn is sent when its previous reply is back):

- shared system prompt: ``--requests`` one-turn chats, each prompt the same system prompt
  and then its own user message of 16-64 tokens;
- multi-turn: ``--requests / --turns`` chats of ``--turns`` turns with no system prompt,
  each turn re-sending the whole history (earlier messages and replies) and a new message;
- no shared prefix: the first workload's prompt lengths, every token its own. It measures
  what the cache costs when it cannot help, so it runs on kvledger only, with and without
  the cache, ``--overhead-runs`` times each in A-B-B-A order on fresh tokens, pooled: a
  single run's CPU time varies by a few percent here, as much as the 3% target.

Measured per system and workload:

- prefill tokens computed: prompt tokens whose K/V the system computed, not found in its
  cache (kvledger: the engine's ``num_prefill_tokens``; transformers exposes no such
  count: "not exposed");
- time to first token, p50 and p99: from the client sending a request (waiting for
  admission included) to its first output token (kvledger: the ``step()`` that returns
  it; transformers: the timestamp it records for the token);
- output tokens/s by wall and by CPU time (``Clock``, as in bench/throughput.py);
- admitted at once: the most requests holding KV together in the fixed pool
  (``--pool-blocks`` of 16 tokens; by default what half of ``--concurrency`` shared-prompt
  requests reserve without sharing). kvledger: requests holding a reservation;
  transformers: requests between leaving its queue and finishing, from their lifespans
  (it allocates as it goes and evicts under pressure; it reserves nothing).

Checked: each reply's token ids with the cache on equal those with it off for the same
prompt (greedy: the cache may change the cost, never the tokens), over every workload.

Exit status 1, one line on stderr per failed check, when a target prints NO or a reply
differs; 0 otherwise.

Not measured: output quality (random weights, greedy, EOS ignored, so each reply is
exactly ``--output-tokens`` long), chat templates (prompts are raw token ids),
tokenization, HTTP. Before each timed run, the system runs one extra conversation of its
shape alone, untimed: a warm-up, which in the shared workload also leaves the system prompt
in the cache, as on a server already serving it.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import os
import random
import sys
import tempfile
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import torch
from throughput import Clock  # bench/ is on sys.path: this script's own folder

from kvledger.engine.model.builtin import MODELS, SPECIAL_TOKENS

BLOCK_SIZE_TOKENS = 16            # kvledger's block and transformers' page: hits are whole blocks
MAX_BATCHED_TOKENS = 2048         # tokens per forward pass, the same for both engines
USER_MESSAGE_TOKENS = (16, 64)    # each user message's length, drawn uniformly
WARMUP_NEW_TOKENS = 4             # reply length of the untimed warm-up conversation
RESULT_WAIT_S = 1.0               # how long one poll of transformers' output queue blocks
TARGET_SPEEDUP = 2.0              # shared system prompt: cache on / off output tokens/s
TARGET_MAX_SLOWDOWN = 0.03        # no shared prefix: cache on at most 3% slower than off

CACHE_ON, CACHE_OFF = "kvledger, prefix cache", "kvledger, no prefix cache"
TRANSFORMERS = "transformers CB, block sharing"
SHARED, MULTI_TURN, NO_SHARED = "shared system prompt", "multi-turn", "no shared prefix"


@dataclass
class Conversation:
    opening: list[int]               # sent before the first user message: a system prompt, or []
    user_messages: list[list[int]]   # one per turn


def workloads(system_prompt_tokens: int, requests: int, turns: int, vocab_size: int,
              seed: int) -> dict[str, list[Conversation]]:
    """Each workload's conversations, the first one the untimed warm-up."""
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(len(SPECIAL_TOKENS), vocab_size) for _ in range(n)]

    def message() -> list[int]:
        return tokens(rng.randint(*USER_MESSAGE_TOKENS))

    system_prompt = tokens(system_prompt_tokens)
    shared = [Conversation(system_prompt, [message()]) for _ in range(requests + 1)]
    chats = max(1, requests // turns)
    return {
        SHARED: shared,
        MULTI_TURN: [Conversation([], [message() for _ in range(turns)]) for _ in range(chats + 1)],
        NO_SHARED: [Conversation(tokens(system_prompt_tokens), [tokens(len(c.user_messages[0]))])
                    for c in shared],
    }


@dataclass
class Run:
    """One or more timed runs of a workload through a system, pooled."""

    requests: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    prefill_tokens: int | None = None   # None: the system does not expose it
    ttft_s: list[float] = field(default_factory=list)
    admitted_at_once: int = 0
    wall_s: float = 0.0
    cpu_s: float = 0.0
    replies: dict[tuple[int, ...], list[int]] = field(default_factory=dict)  # prompt -> reply

    def __iadd__(self, other: Run) -> Run:
        self.requests += other.requests
        self.prompt_tokens += other.prompt_tokens
        self.output_tokens += other.output_tokens
        if other.prefill_tokens is not None:
            self.prefill_tokens = (self.prefill_tokens or 0) + other.prefill_tokens
        self.ttft_s += other.ttft_s
        self.admitted_at_once = max(self.admitted_at_once, other.admitted_at_once)
        self.wall_s += other.wall_s
        self.cpu_s += other.cpu_s
        self.replies.update(other.replies)
        return self

    def rates(self) -> tuple[float, float]:
        """(output tokens per wall second, per CPU second)"""
        return self.output_tokens / self.wall_s, self.output_tokens / self.cpu_s


class KVLedgerDriver:
    """kvledger's ``LLMEngine`` driven as ``LLM.generate`` drives it (add_request until the
    ledger refuses, then step), so each request's first token is seen the step it is sampled."""

    def __init__(self, llm) -> None:
        self.engine = llm.engine
        self.unadmitted: deque = deque()   # sent, waiting for the ledger to admit them
        self.sent_at: dict[str, float] = {}
        self.ids = itertools.count()
        self.begin()

    def begin(self) -> None:
        self.ttft_s: list[float] = []
        self.admitted = self.admitted_at_once = 0
        self.prefill_at_begin = self.engine.num_prefill_tokens

    def submit(self, prompt: list[int], max_tokens: int) -> str:
        from kvledger.engine import SamplingParams

        request_id = f"prefix-{next(self.ids)}"
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        self.unadmitted.append((request_id, prompt, params))
        self.sent_at[request_id] = time.perf_counter()
        return request_id

    def wait(self) -> list[tuple[str, list[int]]]:
        """Admit what the pool holds, run one step; the requests it finished, with their replies."""
        self._admit()
        finished = []
        for out in self.engine.step():
            if out.new_token_ids and len(out.token_ids) == len(out.new_token_ids):
                self.ttft_s.append(time.perf_counter() - self.sent_at.pop(out.request_id))
            if out.finished:
                if out.finish_reason != "length":
                    raise RuntimeError(f"{out.request_id} finished with {out.finish_reason}: {out.error}")
                self.admitted -= 1
                finished.append((out.request_id, out.token_ids))
        return finished

    def _admit(self) -> None:
        from kvledger.engine.errors import AdmissionRejected

        while self.unadmitted:
            try:
                self.engine.add_request(*self.unadmitted[0])
            except AdmissionRejected:
                if not self.admitted:
                    raise  # nothing running will free blocks: the pool is too small for it
                return
            self.unadmitted.popleft()
            self.admitted += 1
            self.admitted_at_once = max(self.admitted_at_once, self.admitted)

    def end(self, run: Run) -> Run:
        run.prefill_tokens = self.engine.num_prefill_tokens - self.prefill_at_begin
        run.ttft_s, run.admitted_at_once = self.ttft_s, self.admitted_at_once
        return run


class TransformersDriver:
    """A running ``ContinuousBatchingManager``: ``add_request`` with ``record_timestamps``,
    then each finished request's ``GenerationOutput`` gives its first token's time and its
    lifespan (when it left the queue, when it finished)."""

    def __init__(self, manager) -> None:
        self.manager = manager
        self.begin()

    def begin(self) -> None:
        self.ttft_s: list[float] = []
        self.lifespans: list[tuple[float, float]] = []

    def submit(self, prompt: list[int], max_tokens: int) -> str:
        request_id = self.manager.add_request(prompt, max_new_tokens=max_tokens,
                                              record_timestamps=True)
        if request_id is None:
            raise RuntimeError("transformers' manager refused a request")
        return request_id

    def wait(self) -> list[tuple[str, list[int]]]:
        """Block for the next finished request (at most RESULT_WAIT_S)."""
        result = self.manager.get_result(timeout=RESULT_WAIT_S)
        if result is None:
            if not self.manager.is_running():
                raise RuntimeError("transformers' generation loop stopped")
            return []
        if result.error is not None:
            raise RuntimeError(f"transformers failed {result.request_id}: {result.error}")
        self.ttft_s.append(result.timestamps[0] - result.created_time)
        self.lifespans.append(result.lifespan)
        return [(result.request_id, result.generated_tokens)]

    def end(self, run: Run) -> Run:
        run.ttft_s, run.admitted_at_once = self.ttft_s, most_overlapping(self.lifespans)
        return run


def most_overlapping(intervals: list[tuple[float, float]]) -> int:
    """The most intervals open at one instant (one ending as another starts: not both)."""
    events = sorted([(start, 1) for start, _ in intervals] + [(end, -1) for _, end in intervals])
    return max(itertools.accumulate(delta for _, delta in events), default=0)


def run_conversations(driver, conversations: list[Conversation], max_tokens: int,
                      concurrency: int) -> Run:
    """Closed loop: at most ``concurrency`` conversations in flight; a conversation sends its
    next turn (history + reply + next message) as soon as its reply is back."""
    run = Run()
    waiting = deque(conversations)
    in_flight: dict[str, tuple[Conversation, int, list[int]]] = {}

    def send(conversation: Conversation, turn: int, history: list[int]) -> None:
        prompt = history + conversation.user_messages[turn]
        in_flight[driver.submit(prompt, max_tokens)] = (conversation, turn, prompt)
        run.requests += 1
        run.prompt_tokens += len(prompt)

    while waiting or in_flight:
        while waiting and len(in_flight) < concurrency:
            conversation = waiting.popleft()
            send(conversation, 0, conversation.opening)
        for request_id, reply in driver.wait():
            conversation, turn, prompt = in_flight.pop(request_id)
            assert len(reply) == max_tokens, (request_id, len(reply))
            run.output_tokens += len(reply)
            run.replies[tuple(prompt)] = list(reply)
            if turn + 1 < len(conversation.user_messages):
                send(conversation, turn + 1, prompt + list(reply))
    return run


def measure(driver, conversations: list[Conversation], output_tokens: int,
            concurrency: int) -> Run:
    """The first conversation alone as an untimed warm-up, then the rest, timed."""
    run_conversations(driver, conversations[:1], WARMUP_NEW_TOKENS, 1)
    driver.begin()
    with Clock() as clock:
        run = run_conversations(driver, conversations[1:], output_tokens, concurrency)
    run.wall_s, run.cpu_s = clock.wall, clock.cpu
    return driver.end(run)


def kvledger_driver(model_dir: str, pool_blocks: int, max_model_len: int, concurrency: int,
                    prefix_caching: bool) -> KVLedgerDriver:
    from kvledger.engine import LLM

    return KVLedgerDriver(LLM(model_dir, max_model_len=max_model_len, max_num_seqs=concurrency,
                              max_num_batched_tokens=MAX_BATCHED_TOKENS,
                              block_size=BLOCK_SIZE_TOKENS, num_gpu_blocks_override=pool_blocks,
                              device="cpu", enable_prefix_caching=prefix_caching))


@contextlib.contextmanager
def transformers_driver(model_dir: str, pool_blocks: int, concurrency: int):
    """Yields (driver, whether its cache shares prefix blocks, its pool in 16-token blocks)."""
    import transformers

    transformers.utils.logging.disable_progress_bar()
    # "sdpa" is one of the two implementations its continuous batching accepts without
    # flash-attn ("paged|eager" is the other, slower on CPU); it reads the paged cache.
    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    generation = transformers.GenerationConfig(do_sample=False, eos_token_id=-1,  # no EOS
                                               pad_token_id=0)
    batching = transformers.ContinuousBatchingConfig(
        page_size=BLOCK_SIZE_TOKENS, num_blocks=pool_blocks, max_batch_tokens=MAX_BATCHED_TOKENS,
        max_requests_per_batch=concurrency, allow_block_sharing=True, auto_switch_to_flash=False)
    with model.continuous_batching_context_manager(generation_config=generation,
                                                   continuous_batching_config=batching) as manager:
        cache = manager.batch_processor.cache  # built by the context manager's warmup()
        yield TransformersDriver(manager), cache.use_prefix_sharing, cache.num_blocks


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile, ``q`` in (0, 1]."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def row(workload: str, system: str, run: Run) -> dict:
    wall, cpu = run.rates()
    return {"workload": workload, "system": system, "requests": run.requests,
            "prompt_tokens": run.prompt_tokens, "prefill_tokens_computed": run.prefill_tokens,
            "ttft_p50_ms": 1000 * percentile(run.ttft_s, 0.5),
            "ttft_p99_ms": 1000 * percentile(run.ttft_s, 0.99),
            "output_tokens_per_wall_s": wall, "output_tokens_per_cpu_s": cpu,
            "admitted_at_once": run.admitted_at_once}


def targets(runs: dict[tuple[str, str], Run], pair_ratios: list[float],
            system_prompt_tokens: int) -> list[dict]:
    """The three targets, judged on CPU-time rates (steadier than wall time on a shared
    machine; wall alongside). ``pair_ratios``: cache on / off, per no-shared-prefix pair."""
    def ratio(workload: str) -> tuple[float, float]:
        on, off = runs[workload, CACHE_ON].rates(), runs[workload, CACHE_OFF].rates()
        return on[1] / off[1], on[0] / off[0]

    speedup, speedup_wall = ratio(SHARED)
    on, off = runs[SHARED, CACHE_ON], runs[SHARED, CACHE_OFF]
    cut = 1 - on.prefill_tokens / off.prefill_tokens
    # The system prompt's whole blocks: what sharing can skip in every request.
    shareable = on.requests * (system_prompt_tokens // BLOCK_SIZE_TOKENS * BLOCK_SIZE_TOKENS)
    shared_fraction = shareable / on.prompt_tokens
    no_share, no_share_wall = ratio(NO_SHARED)
    by_pair = ", ".join(_slower(r) for r in pair_ratios)
    return [
        {"target": f"{SHARED}: cache on / off output tokens/s >= {TARGET_SPEEDUP:g}x",
         "value": f"{speedup:.2f}x (wall {speedup_wall:.2f}x)", "met": speedup >= TARGET_SPEEDUP},
        {"target": f"{SHARED}: prefill tokens computed cut by the shared fraction "
                   f"({shared_fraction:.1%}: the system prompt's whole blocks)",
         "value": f"cut {cut:.1%}", "met": cut >= shared_fraction},
        {"target": f"{NO_SHARED}: cache on at most {TARGET_MAX_SLOWDOWN:.0%} slower than off",
         "value": f"{_slower(no_share)} pooled (by pair: {by_pair}; wall "
                  f"{_slower(no_share_wall)})",
         "met": no_share >= 1 - TARGET_MAX_SLOWDOWN},
    ]


def compare_replies(runs: dict[tuple[str, str], Run]) -> dict:
    """Each kvledger request's reply with the cache on against the reply to the same prompt
    with it off, over every workload: how many compared, how many differ (a prompt the other
    system never sent, as after an earlier turn's reply differed, counts as differing)."""
    compared = mismatched = 0
    for workload, system in runs:
        if system != CACHE_OFF or (workload, CACHE_ON) not in runs:
            continue
        on, off = runs[workload, CACHE_ON].replies, runs[workload, CACHE_OFF].replies
        for prompt in on.keys() | off.keys():
            compared += 1
            mismatched += on.get(prompt) != off.get(prompt)
    return {"compared": compared, "mismatched": mismatched}


def failures(goals: list[dict], replies: dict) -> list[str]:
    """One line per failed check: each target not met, and replies that differ."""
    lines = [f"target not met: {g['target']} (measured {g['value']})"
             for g in goals if not g["met"]]
    if not replies["compared"]:
        lines.append("greedy replies, prefix cache on vs off: no requests to compare")
    elif replies["mismatched"]:
        lines.append(f"greedy replies with the prefix cache differ from those without it: "
                     f"{replies['mismatched']} of {replies['compared']} requests")
    return lines


def _slower(on_over_off: float) -> str:
    if on_over_off < 1:
        return f"{1 - on_over_off:.1%} slower"
    return f"{on_over_off - 1:.1%} faster"


def markdown(rows: list[dict], goals: list[dict]) -> str:
    lines = ["| workload | system | requests | prompt tokens | prefill tokens computed | "
             "TTFT p50 ms | TTFT p99 ms | output tok/s wall | output tok/s CPU | admitted at once |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        prefill = "not exposed" if r["prefill_tokens_computed"] is None else r["prefill_tokens_computed"]
        lines.append(f"| {r['workload']} | {r['system']} | {r['requests']} | {r['prompt_tokens']} | "
                     f"{prefill} | {r['ttft_p50_ms']:.0f} | {r['ttft_p99_ms']:.0f} | "
                     f"{r['output_tokens_per_wall_s']:.1f} | {r['output_tokens_per_cpu_s']:.1f} | "
                     f"{r['admitted_at_once']} |")
    lines += ["", "| target | measured | met |", "|---|---|---|"]
    lines += [f"| {g['target']} | {g['value']} | {'yes' if g['met'] else 'NO'} |" for g in goals]
    return "\n".join(lines)


def sizes(args: argparse.Namespace) -> tuple[int, int]:
    """(max_model_len, pool blocks): room for the longest request; the pool by default holds
    half of ``--concurrency`` shared-prompt requests when nothing is shared."""
    def blocks(tokens: int) -> int:
        return -(-tokens // BLOCK_SIZE_TOKENS)

    longest_message = USER_MESSAGE_TOKENS[1]
    one_turn = args.system_prompt_tokens + longest_message + args.output_tokens
    last_turn = args.turns * (longest_message + args.output_tokens)
    max_model_len = blocks(max(one_turn, last_turn)) * BLOCK_SIZE_TOKENS
    pool_blocks = args.pool_blocks or max(blocks(max_model_len),
                                          max(1, args.concurrency // 2) * blocks(one_turn))
    return max_model_len, pool_blocks


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--model", default="small-llama", choices=sorted(MODELS),
                        help="built-in model name")
    parser.add_argument("--requests", type=_positive_int, default=24,
                        help="requests per workload (multi-turn: requests / turns chats)")
    parser.add_argument("--concurrency", type=_positive_int, default=8,
                        help="conversations in flight at once")
    parser.add_argument("--output-tokens", type=_positive_int, default=32)
    parser.add_argument("--system-prompt-tokens", type=_positive_int, default=384)
    parser.add_argument("--turns", type=_positive_int, default=4)
    parser.add_argument("--overhead-runs", type=_positive_int, default=4,
                        help="runs of the no-shared-prefix workload per kvledger system (one "
                             "on/off pair varies by up to 8%% on a shared 2-core machine: "
                             "fewer pairs cannot tell 3%%)")
    parser.add_argument("--pool-blocks", type=_positive_int, default=None,
                        help=f"KV pool in {BLOCK_SIZE_TOKENS}-token blocks, for every system")
    parser.add_argument("--threads", type=_positive_int, default=1,
                        help="torch CPU threads (default 1: CPU-time rates stay comparable)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead")
    args = parser.parse_args()
    max_model_len, pool_blocks = sizes(args)
    if pool_blocks * BLOCK_SIZE_TOKENS < max_model_len:
        parser.error(f"--pool-blocks {pool_blocks} cannot hold the longest request "
                     f"({max_model_len} tokens)")
    return args


def run_all(drivers: dict, args: argparse.Namespace,
            vocab_size: int) -> tuple[dict[tuple[str, str], Run], list[float]]:
    """Every (workload, system) run, pooled; and cache on / off CPU rate per no-shared pair."""
    runs: dict[tuple[str, str], Run] = {}

    def timed(workload: str, system: str, conversations: list[Conversation]) -> Run:
        run = measure(drivers[system], conversations, args.output_tokens, args.concurrency)
        runs.setdefault((workload, system), Run())
        runs[workload, system] += run
        print(f"{workload} / {system}: {run.wall_s:.2f} s", file=sys.stderr, flush=True)
        return run

    def plan(seed: int) -> dict[str, list[Conversation]]:
        return workloads(args.system_prompt_tokens, args.requests, args.turns, vocab_size, seed)

    first = plan(0)
    for workload in (SHARED, MULTI_TURN):
        for system in drivers:
            timed(workload, system, first[workload])
    pair_ratios = []
    for i in range(args.overhead_runs):  # A-B-B-A: drift in the machine's load cancels
        conversations = plan(1 + i)[NO_SHARED]
        order = (CACHE_ON, CACHE_OFF) if i % 2 == 0 else (CACHE_OFF, CACHE_ON)
        cpu_rates = {system: timed(NO_SHARED, system, conversations).rates()[1] for system in order}
        pair_ratios.append(cpu_rates[CACHE_ON] / cpu_rates[CACHE_OFF])
    return runs, pair_ratios


def main() -> int:
    args = parse_args()
    from kvledger.engine.model.builtin import write_model

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    max_model_len, pool_blocks = sizes(args)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        model_dir = str(write_model(args.model, tmp))
        vocab = json.loads(Path(model_dir, "config.json").read_text())["vocab_size"]
        drivers = {name: kvledger_driver(model_dir, pool_blocks, max_model_len, args.concurrency, on)
                   for name, on in ((CACHE_ON, True), (CACHE_OFF, False))}
        drivers[TRANSFORMERS], hf_sharing, hf_blocks = stack.enter_context(
            transformers_driver(model_dir, pool_blocks, args.concurrency))
        runs, pair_ratios = run_all(drivers, args, vocab)
    report = {"model": args.model, "threads": args.threads, "concurrency": args.concurrency,
              "output_tokens": args.output_tokens, "system_prompt_tokens": args.system_prompt_tokens,
              "turns": args.turns, "overhead_runs": args.overhead_runs,
              "pool_blocks": pool_blocks, "block_size_tokens": BLOCK_SIZE_TOKENS,
              "transformers_pool_blocks": hf_blocks, "transformers_prefix_sharing": hf_sharing,
              "rows": [row(workload, system, run) for (workload, system), run in runs.items()],
              "targets": targets(runs, pair_ratios, args.system_prompt_tokens),
              "greedy_replies": compare_replies(runs),
              "run_s": time.perf_counter() - started, "load_average": os.getloadavg()[0]}
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"model {args.model}, {args.threads} torch thread(s), concurrency "
              f"{args.concurrency}, {args.output_tokens} output tokens per reply, system prompt "
              f"{args.system_prompt_tokens} tokens, {args.turns} turns; KV pool {pool_blocks} "
              f"blocks of {BLOCK_SIZE_TOKENS} tokens (transformers: {hf_blocks}, prefix sharing "
              f"{'on' if hf_sharing else 'OFF'})\n")
        print(markdown(report["rows"], report["targets"]))
        replies = report["greedy_replies"]
        print(f"\ngreedy replies, prefix cache on vs off: {replies['compared']} requests "
              f"compared, {replies['mismatched']} differ")
        print(f"\nran {report['run_s']:.0f} s; load average at the end "
              f"{report['load_average']:.1f}")
    failed = failures(report["targets"], report["greedy_replies"])
    for line in failed:
        print(f"prefix: FAILED: {line}", file=sys.stderr, flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
