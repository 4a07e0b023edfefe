"""What logprobs and structured outputs cost: output tokens/s of one real ``kvledger
serve`` on the same chat workload, plain, with ``logprobs: true, top_logprobs: 5``, and
with a ``response_format`` json_schema mask, over HTTP (so the cost of formatting the
logprobs into JSON counts too).

Modes run in interleaved rounds (plain, logprobs, schema, plain, ...) so that anything
else on the machine slows them alike; the median round of each mode is reported, and
its ratio to plain. The issue's targets: logprobs cost at most 10% of tokens/s, the
json_schema mask at most 25%.

    .venv/bin/python bench/openai_features.py [--model small-llama] [--rounds 3]

Every response (warm-up included) is checked once its round is timed: one asked for
logprobs carries one entry per generated token, each with ``top_logprobs`` as many as
asked; a json_schema output that finished with "stop" parses and validates against the
schema (``jsonschema``); one cut by "length" is a prefix of schema-conforming JSON
(llguidance, on the served model's tokenizer, with the schema as the server compiles it).
(With random weights the outputs rarely finish within ``--max-tokens``: most are cut, so
checked as prefixes.) Exit status 1, one line on stderr per failed check, when any
response fails one, or when no response of a mode was checked.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import jsonschema
from local_server import free_port, wait_ready

SCHEMA = {"type": "object",
          "properties": {"title": {"type": "string"}, "year": {"type": "integer"},
                         "tags": {"type": "array", "items": {"type": "string"}}},
          "required": ["title", "year", "tags"]}
MODES = {
    "plain": {},
    "top_logprobs 5": {"logprobs": True, "top_logprobs": 5},
    "json_schema": {"response_format": {"type": "json_schema",
                                        "json_schema": {"name": "film", "schema": SCHEMA}}},
}


@dataclass
class Checks:
    """What the responses were checked for, over the whole run."""

    logprobs: int = 0         # responses that asked for logprobs, checked
    schema_complete: int = 0  # json_schema outputs finished with "stop", validated whole
    schema_cut: int = 0       # json_schema outputs cut by "length", checked as prefixes
    problems: list[str] = field(default_factory=list)

    def failures(self) -> list[str]:
        """One line per failed check."""
        lines = list(self.problems)
        if not self.logprobs:
            lines.append("logprobs: no response was checked")
        if not self.schema_complete + self.schema_cut:
            lines.append("json_schema: no output was checked")
        return lines

    def summary(self) -> str:
        return (f"checked: {self.logprobs} logprobs responses (one entry per token, top_logprobs "
                f"as asked); json_schema: {self.schema_complete} finished outputs validated, "
                f"{self.schema_cut} cut by length checked as prefixes; "
                f"{len(self.failures())} failed check(s)")


def logprobs_problem(choice: dict, completion_tokens: int, top: int) -> str | None:
    """What is wrong with a chat choice's ``logprobs``, asked with ``top_logprobs`` ``top``:
    one entry per generated token, each a token with a logprob and ``top`` alternatives in
    decreasing order; None when nothing is."""
    content = (choice.get("logprobs") or {}).get("content")
    if not isinstance(content, list):
        return f"no logprobs.content in a response that asked for them: {choice.get('logprobs')!r}"
    if len(content) != completion_tokens:
        return f"{len(content)} logprobs entries for {completion_tokens} generated tokens"
    for position, entry in enumerate(content):
        if not _token_logprob(entry):
            return f"logprobs entry {position} is not a token logprob: {entry!r:.200}"
        alternatives = entry.get("top_logprobs")
        if not isinstance(alternatives, list) or len(alternatives) != top:
            count = len(alternatives) if isinstance(alternatives, list) else "no"
            return f"logprobs entry {position} has {count} top_logprobs, {top} asked"
        if not all(_token_logprob(a) for a in alternatives):
            return f"logprobs entry {position} has a malformed top_logprobs entry"
        values = [a["logprob"] for a in alternatives]
        if values != sorted(values, reverse=True):
            return f"logprobs entry {position}'s top_logprobs are not most likely first"
    return None


def _token_logprob(entry) -> bool:
    return (isinstance(entry, dict) and isinstance(entry.get("token"), str)
            and isinstance(entry.get("logprob"), int | float) and entry["logprob"] <= 0
            and isinstance(entry.get("bytes"), list))


def schema_problem(choice: dict, is_prefix) -> tuple[str, str | None]:
    """("complete" or "cut", what is wrong with a json_schema choice's content or None).
    ``is_prefix(text)``: whether ``text`` is a prefix of schema-conforming JSON."""
    reason, content = choice["finish_reason"], choice["message"]["content"]
    if reason == "length":
        if not is_prefix(content):
            return "cut", (f"an output cut by length is no prefix of the schema's JSON: "
                           f"{content!r:.200}")
        return "cut", None
    if reason != "stop":
        return "complete", f"finish_reason {reason!r}, expected \"stop\" or \"length\""
    try:
        jsonschema.validate(json.loads(content), SCHEMA)
    except (ValueError, jsonschema.ValidationError) as exc:
        message = str(exc).splitlines()[0]
        return "complete", f"a finished output does not validate ({message}): {content!r:.200}"
    return "complete", None


def schema_prefix_check(model_dir: str):
    """``is_prefix(text)``: llguidance, on the model's tokenizer, walks the tokens of ``text``
    through the schema's grammar compiled as the server compiles it (keys sorted,
    engine/server/protocol.py); True when it accepts every one."""
    from llguidance import LLMatcher, LLTokenizer

    config = json.loads(Path(model_dir, "config.json").read_text())
    tokenizer = LLTokenizer(Path(model_dir, "tokenizer.json").read_text(),
                            n_vocab=config["vocab_size"], eos_token=config["eos_token_id"])
    grammar = LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA, sort_keys=True))

    def is_prefix(text: str) -> bool:
        matcher = LLMatcher(tokenizer, grammar, log_level=0)
        tokens = tokenizer.tokenize_str(text)
        return not matcher.is_error() and matcher.validate_tokens(tokens) == len(tokens)

    return is_prefix


def check_round(extra: dict, answers: list[dict], checks: Checks, is_prefix) -> None:
    """Check one round's answers for what ``extra`` asked, into ``checks``."""
    for answer in answers:
        choice = answer["choices"][0]
        problems = []
        if extra.get("logprobs"):
            checks.logprobs += 1
            problems.append(logprobs_problem(choice, answer["usage"]["completion_tokens"],
                                             extra.get("top_logprobs") or 0))
        if "response_format" in extra:
            kind, problem = schema_problem(choice, is_prefix)
            if kind == "cut":
                checks.schema_cut += 1
            elif problem is None:
                checks.schema_complete += 1
            problems.append(problem)
        checks.problems += [problem for problem in problems if problem is not None]


async def one_round(base: str, model: str, extra: dict, requests: int, concurrency: int,
                    max_tokens: int) -> tuple[int, float, list[dict]]:
    """(output tokens, seconds, the answers) for ``requests`` chats, ``concurrency`` at a time."""
    queue = list(range(requests))
    tokens = 0
    answers = []

    async def client(session: aiohttp.ClientSession) -> None:
        nonlocal tokens
        while queue:
            i = queue.pop()
            body = {"model": model, "max_tokens": max_tokens, "temperature": 1.0, "seed": i,
                    "ignore_eos": True, **extra,
                    "messages": [{"role": "user", "content": f"Describe film number {i}."}]}
            async with session.post(base + "/v1/chat/completions", json=body) as response:
                answer = await response.json()
                if response.status != 200:
                    sys.exit(f"{response.status}: {answer}")
                answers.append(answer)  # checked once the round is timed
                tokens += answer["usage"]["completion_tokens"]

    started = time.perf_counter()
    async with aiohttp.ClientSession() as session:
        await asyncio.gather(*(client(session) for _ in range(concurrency)))
    return tokens, time.perf_counter() - started, answers


async def run(args: argparse.Namespace, base: str, proc: subprocess.Popen, checks: Checks,
              is_prefix) -> dict:
    model = await wait_ready(base, proc)
    for extra in MODES.values():  # warm-up: first-call costs, the grammar's first compile
        *_, answers = await one_round(base, model, extra, args.concurrency, args.concurrency, 8)
        check_round(extra, answers, checks, is_prefix)
    rates: dict[str, list[float]] = {mode: [] for mode in MODES}
    for _ in range(args.rounds):
        for mode, extra in MODES.items():
            tokens, seconds, answers = await one_round(base, model, extra, args.requests,
                                                       args.concurrency, args.max_tokens)
            rates[mode].append(tokens / seconds)
            check_round(extra, answers, checks, is_prefix)
    return {mode: statistics.median(values) for mode, values in rates.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--model", default="small-llama", help="built-in model name")
    parser.add_argument("--requests", type=int, default=32, help="per round and mode")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args()
    kvledger = os.path.join(os.path.dirname(sys.executable), "kvledger")
    checks = Checks()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = os.path.join(tmp, args.model)
        subprocess.run([kvledger, "make-model", args.model, model_dir], check=True,
                       stdout=subprocess.DEVNULL)
        is_prefix = schema_prefix_check(model_dir)
        port = free_port()
        proc = subprocess.Popen([kvledger, "serve", "--model", model_dir, "--device", "cpu",
                                 "--port", str(port), "--max-model-len", "512",
                                 "--max-num-seqs", str(args.concurrency)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            rates = asyncio.run(run(args, f"http://127.0.0.1:{port}", proc, checks, is_prefix))
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    if args.json:
        print(json.dumps(rates))
        print(checks.summary(), file=sys.stderr)
    else:
        print(f"model {args.model}, {args.rounds} rounds x {args.requests} chats, concurrency "
              f"{args.concurrency}, up to {args.max_tokens} tokens each (median round)")
        for mode, rate in rates.items():
            print(f"{mode:<16}{rate:>9.1f} tok/s   {rate / rates['plain']:.2f}x plain")
        print(checks.summary())
    failed = checks.failures()
    for line in failed[:10]:
        print(f"openai_features: FAILED: {line}", file=sys.stderr)
    if len(failed) > 10:
        print(f"openai_features: FAILED: ... and {len(failed) - 10} more", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
