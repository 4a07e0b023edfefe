"""bench/tenants.py's workloads: the request shapes, seeded so that every server is sent
the same requests, and the servers (systems) each workload runs on. The measuring, the
claims and the report are tenants.py's; its docstring describes the workloads."""

from __future__ import annotations

import random
from dataclasses import dataclass

from serving import OVERLOAD_POOL_BLOCKS, VOCAB_SIZE

from kvledger.engine.model.builtin import SPECIAL_TOKENS

POOL_BLOCKS = OVERLOAD_POOL_BLOCKS          # 32 blocks of 32 tokens, as serving.py's overload
MIN_POOL_BLOCKS = 16                        # 12 for the largest flood request, 4 kept of 16
FLOOD_PROMPT_TOKENS = (64, 128)
FLOOD_MAX_TOKENS = (128, 192, 256)
SERVICE_SHAPE = (96, 192)                   # the flood's median prompt and max_tokens
SMALL_PROMPT_TOKENS, SMALL_MAX_TOKENS = 16, 16  # a light or urgent request
PERIOD_S = 2.0                              # light / urgent arrivals: gaps of 1-3 s
RAMP_S = 5.0                                # the flood alone before the window opens
KEYS = {"flood": "bench-tenant-a", "small": "bench-tenant-b"}
BEST_EFFORT_PRIORITY, URGENT_PRIORITY = 10, 0
# Sized to the urgent traffic: of the 32-block pool, 0.1 keeps 4 blocks and 4 of the 32
# seats, four urgent requests (one block each) at once. 0.25 (8 blocks) measured 0.75x
# vLLM's best-effort goodput: a flood request takes up to 12 blocks.
HEADROOM = "0.1"

ARRIVAL, FAIR, VLLM = "kvledger-arrival", "kvledger-fair", "vllm"
HEADROOM_SYS, NO_HEADROOM, VLLM_PRIORITY = "kvledger-headroom", "kvledger-priority", "vllm-priority"
LABELS = {ARRIVAL: "kvledger --no-tenant-fairness", FAIR: "kvledger (fair)", VLLM: "vLLM",
          HEADROOM_SYS: f"kvledger priority, headroom {HEADROOM}",
          NO_HEADROOM: "kvledger priority, no headroom", VLLM_PRIORITY: "vLLM priority"}


@dataclass(frozen=True)
class System:
    name: str
    engine: str                  # kvledger | vllm
    flags: tuple[str, ...] = ()


def systems_of(vllm_found: bool, plain_priority_too: bool) -> tuple[list[System], list[System]]:
    """The servers of workload 1 and of workload 2, in the order of a round's first half."""
    keys = ("--api-key", KEYS["flood"], KEYS["small"])
    priority = ("--scheduling-policy", "priority")
    one = [System(ARRIVAL, "kvledger", (*keys, "--no-tenant-fairness")),
           System(FAIR, "kvledger", keys)]
    two = [System(HEADROOM_SYS, "kvledger", (*keys, *priority, "--priority-headroom", HEADROOM))]
    if plain_priority_too:
        two.append(System(NO_HEADROOM, "kvledger", (*keys, *priority)))
    if vllm_found:
        one.append(System(VLLM, "vllm"))
        two.insert(1, System(VLLM_PRIORITY, "vllm", priority))
    return one, two


# -- the requests -----------------------------------------------------------------------

def _tokens(rng: random.Random, count: int) -> list[int]:
    return [rng.randrange(len(SPECIAL_TOKENS), VOCAB_SIZE) for _ in range(count)]


def flood_requests(seed: int, client: int):
    """Flood client ``client``'s endless (prompt token ids, max_tokens), the same for every
    server given the seed."""
    rng = random.Random(f"{seed}-flood-{client}")
    while True:
        yield _tokens(rng, rng.randint(*FLOOD_PROMPT_TOKENS)), rng.choice(FLOOD_MAX_TOKENS)


def small_prompts(seed: int, tag: str):
    """Endless 16-token prompts of the light or urgent tenant (``tag`` keeps the idle ones
    apart from those sent under the flood)."""
    rng = random.Random(f"{seed}-small-{tag}")
    while True:
        yield _tokens(rng, SMALL_PROMPT_TOKENS)


def arrival_offsets(seed: int, window_s: float, period_s: float = PERIOD_S) -> list[float]:
    """When the light or urgent requests are sent, seconds into the window: the first at
    0, then seeded gaps of 0.5-1.5 x ``period_s``, all before the window closes."""
    rng = random.Random(f"{seed}-arrivals")
    offsets, at = [], 0.0
    while at < window_s:
        offsets.append(at)
        at += rng.uniform(0.5, 1.5) * period_s
    return offsets


def idle_shapes(seed: int, count: int) -> list[tuple[list[int], int]]:
    prompts = small_prompts(seed, "idle")
    return [(next(prompts), SMALL_MAX_TOKENS) for _ in range(count)]


def service_shapes(seed: int, count: int) -> list[tuple[list[int], int]]:
    rng = random.Random(f"{seed}-service")
    return [(_tokens(rng, SERVICE_SHAPE[0]), SERVICE_SHAPE[1]) for _ in range(count)]
