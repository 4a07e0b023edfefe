"""What drawing reserved blocks lazily buys: the prefix cache lives in the blocks that
admitted requests have reserved but not yet written.

A reservation claims ``prompt + cap`` blocks for its request's whole life, and most of
that claim is written late: the output cap is reached a token per step, or never (an
early stop). kvledger's ledger takes a physical block only when the request writes it
(``grow``), so until then the claimed-but-unwritten blocks keep holding cached prefixes
that later requests pin. The other way to keep the same promise is to take every block
at admission; it keeps the guarantee just as well, but each admission evicts as many
cached blocks as its cap is long.

This runs the real ``KVLedger`` (the engine's verbs: ``try_reserve``, ``grow``,
``register``, ``release``) over one seeded workload, both ways, with no model: a
simulated step writes one token of every running request; prompts are written in the
step that admits them. The workload mixes chats that share one of ``--tenants`` system
prompts (each request: its tenant's system prompt, then its own message), conversations
that re-send their history turn after turn, and requests that stop early (EOS) before
their cap. Admission is FIFO, ``--max-num-seqs`` at a time, on ``--pool-blocks`` blocks.

Measured both ways: prompt tokens found in the cache (of those that could be), prompt
tokens computed, cached blocks evicted, the mean number of cached (evictable) blocks,
and the steps the workload took. The guarantee is checked both ways (no ``grow`` fails;
the ledger ends empty).

Exit status 1, one ``lazy_draws: FAILED:`` line each, when lazy draws do not find more
prompt tokens in the cache than drawing at admission does, or when either way breaks
the ledger's rule.

    .venv/bin/python bench/lazy_draws.py [--requests 600] [--pool-blocks 96] [--json]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections import deque
from dataclasses import dataclass, field

from kvledger.engine.kv.ledger import KVLedger

BLOCK_SIZE = 16


@dataclass
class Request:
    client: int
    prompt: list[int]
    cap: int
    output_len: int             # where it stops (EOS), at most its cap
    output: list[int] = field(default_factory=list)


class Clients:
    """``--clients`` users, each with one request in flight at a time: a conversation of
    1-4 turns under one of ``--tenants`` system prompts, each turn re-sending the history
    (the system prompt, earlier messages and replies) and a new message of 16-64 tokens;
    then a new conversation. Caps from 64/128/256/384; half the replies stop early (EOS)
    at a quarter to all of their cap. Seeded: both ways see the same requests."""

    def __init__(self, args) -> None:
        self.args, self.rng = args, random.Random(args.seed)
        self.systems = [self._tokens(args.system_prompt_tokens) for _ in range(args.tenants)]
        self.history: dict[int, list[int]] = {}
        self.turns_left: dict[int, int] = {}
        self.sent = 0

    def _tokens(self, count: int) -> list[int]:
        return [self.rng.randrange(1, 30000) for _ in range(count)]

    def next(self, client: int, finished: Request | None = None) -> Request | None:
        """``client``'s next request (after ``finished``, its previous one), or None when
        ``--requests`` have been sent."""
        if self.sent >= self.args.requests:
            return None
        self.sent += 1
        if finished is not None and self.turns_left[client] > 0:
            history = finished.prompt + finished.output
        else:
            history = list(self.rng.choice(self.systems))
            self.turns_left[client] = self.rng.randint(1, 4)
        self.turns_left[client] -= 1
        prompt = history + self._tokens(self.rng.randint(16, 64))
        if len(prompt) + 64 > self.args.max_model_len:  # the history is full: a new chat
            self.turns_left[client] = 0
            self.sent -= 1
            return self.next(client)
        cap = min(self.rng.choice((64, 128, 256, 384)), self.args.max_model_len - len(prompt))
        stops = self.rng.random() < 0.5
        return Request(client, prompt, cap, self.rng.randint(cap // 4, cap) if stops else cap)


@dataclass
class Outcome:
    queried_tokens: int = 0
    hit_tokens: int = 0
    computed_prompt_tokens: int = 0
    evictions: int = 0
    cached_block_steps: int = 0
    steps: int = 0
    errors: list[str] = field(default_factory=list)

    def summary(self) -> dict:
        return {"prompt_tokens_cacheable": self.queried_tokens,
                "prompt_tokens_found_cached": self.hit_tokens,
                "hit_rate": self.hit_tokens / self.queried_tokens,
                "prompt_tokens_computed": self.computed_prompt_tokens,
                "evictions": self.evictions,
                "mean_cached_blocks": self.cached_block_steps / self.steps,
                "steps": self.steps, "errors": self.errors}


def simulate(args, *, eager: bool) -> Outcome:
    """Run the seeded clients to the end on a fresh ledger; ``eager`` draws every
    reserved block at admission instead of as tokens are written."""
    ledger = KVLedger(args.pool_blocks, BLOCK_SIZE, enable_prefix_caching=True)
    clients = Clients(args)
    queue = deque(clients.next(client) for client in range(args.clients))
    running: list[tuple[Request, object]] = []
    outcome = Outcome()
    rng = random.Random(args.seed + 1)
    while queue or running:
        # Admit in FIFO order while the head fits.
        while queue and len(running) < args.max_num_seqs:
            request = queue[0]
            reservation = ledger.try_reserve(len(request.prompt) + request.cap, request.prompt)
            if reservation is None:
                break
            queue.popleft()
            outcome.computed_prompt_tokens += len(request.prompt) - reservation.num_cached_tokens
            try:
                ledger.grow(reservation, len(request.prompt) + request.cap if eager
                            else len(request.prompt))
            except RuntimeError as exc:
                outcome.errors.append(f"grow at admission: {exc}")
            ledger.prefix_cache.register(reservation, request.prompt, len(request.prompt))
            running.append((request, reservation))
        if not running:
            outcome.errors.append("the head of the line can never be admitted")
            break
        # One step: every running request writes one token.
        still = []
        for request, reservation in running:
            request.output.append(rng.randrange(1, 30000))
            tokens = request.prompt + request.output
            try:
                ledger.grow(reservation, len(tokens))
            except RuntimeError as exc:
                outcome.errors.append(f"grow mid-flight: {exc}")
            ledger.prefix_cache.register(reservation, tokens, len(tokens) - 1)  # the last is not computed yet
            if len(request.output) < request.output_len:
                still.append((request, reservation))
                continue
            ledger.release(reservation)
            follow_up = clients.next(request.client, request)
            if follow_up is not None:
                queue.append(follow_up)
        running = still
        outcome.steps += 1
        outcome.cached_block_steps += ledger.cached_blocks
    outcome.queried_tokens = ledger.prefix_cache.queries
    outcome.hit_tokens = ledger.prefix_cache.hits
    outcome.evictions = ledger.evicted_blocks
    if ledger.reserved_blocks or ledger.used_blocks:
        outcome.errors.append(f"ledger not empty at the end: {ledger.reserved_blocks} reserved")
    return outcome


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--requests", type=int, default=600)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--pool-blocks", type=int, default=96)
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--tenants", type=int, default=4)
    parser.add_argument("--system-prompt-tokens", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    lazy = simulate(args, eager=False).summary()
    eager = simulate(args, eager=True).summary()
    report = {"config": vars(args), "lazy": lazy, "at_admission": eager}
    failed = [f"{name}: {error}" for name, result in (("lazy", lazy), ("at admission", eager))
              for error in result["errors"]]
    if lazy["prompt_tokens_found_cached"] <= eager["prompt_tokens_found_cached"]:
        failed.append(f"lazy draws found {lazy['prompt_tokens_found_cached']} prompt tokens "
                      f"cached, drawing at admission {eager['prompt_tokens_found_cached']}")
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print(f"{args.requests} requests from {args.clients} clients, {args.pool_blocks} blocks of "
              f"{BLOCK_SIZE}, max {args.max_num_seqs} running, {args.tenants} system prompts "
              f"of {args.system_prompt_tokens} tokens\n")
        print("| | lazy draws (kvledger) | every block at admission |\n|---|---:|---:|")
        rows = (("prompt tokens found cached", lambda r: f"{r['prompt_tokens_found_cached']} "
                 f"of {r['prompt_tokens_cacheable']} ({r['hit_rate']:.0%})"),
                ("prompt tokens computed", lambda r: r["prompt_tokens_computed"]),
                ("cached blocks evicted", lambda r: r["evictions"]),
                ("cached blocks, mean per step", lambda r: f"{r['mean_cached_blocks']:.1f}"),
                ("steps to finish", lambda r: r["steps"]))
        for label, show in rows:
            print(f"| {label} | {show(lazy)} | {show(eager)} |")
    for line in failed:
        print(f"lazy_draws: FAILED: {line}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
