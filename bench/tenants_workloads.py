"""bench/tenants.py's workloads: the request shapes, seeded so that every server is sent
the same requests, and the servers (systems) each workload runs on. The measuring, the
claims and the report are tenants.py's; its docstring describes the workloads."""

from __future__ import annotations

import random
from dataclasses import dataclass

from serving import MAX_NUM_SEQS, OVERLOAD_POOL_BLOCKS, VOCAB_SIZE

from kvledger.engine.model.builtin import SPECIAL_TOKENS

POOL_BLOCKS = OVERLOAD_POOL_BLOCKS          # 32 blocks of 32 tokens, as serving.py's overload
MIN_POOL_BLOCKS = 16                        # 12 for the largest flood request, 4 kept of 16
FLOOD_PROMPT_TOKENS = (64, 128)
FLOOD_MAX_TOKENS = (128, 192, 256)
SERVICE_SHAPE = (96, 192)                   # the flood's median prompt and max_tokens
SMALL_PROMPT_TOKENS, SMALL_MAX_TOKENS = 16, 16  # a light or urgent request
PERIOD_S = 2.0                              # light / urgent arrivals: gaps of 1-3 s
RAMP_S = 5.0                                # the flood alone before the window opens
# Workload 3: the seats' first holders would all start together and none would end before
# the shortest of them, whatever the line's order; the flood's clients start spread over
# the ramp's first half, and the window opens once their requests end out of step (a
# flood request at 8 seats takes ~8-25 s on 2 cores), as under a flood that has run a while.
SEATS_RAMP_S = 30.0
KEYS = {"flood": "bench-tenant-a", "small": "bench-tenant-b"}
BEST_EFFORT_PRIORITY, URGENT_PRIORITY = 10, 0
# Sized to the urgent traffic: of the 32-block pool, 0.1 keeps 4 blocks and 4 of the 32
# seats, four urgent requests (one block each) at once. 0.25 (8 blocks) measured 0.75x
# vLLM's best-effort goodput: a flood request takes up to 12 blocks.
HEADROOM = "0.1"
# Workload 3, the seats the bottleneck: --max-num-seqs SEATS, and a pool that admits every
# flood request at once at its largest (12 blocks of 32: 128 + 256 tokens), with
# SEATS_SPARE_BLOCKS more for the light requests (one block each) waiting beside them.
SEATS = 8
BLOCK_TOKENS = 32                           # serving.py's --block-size
LARGEST_FLOOD_BLOCKS = -(-(FLOOD_PROMPT_TOKENS[1] + FLOOD_MAX_TOKENS[-1]) // BLOCK_TOKENS)
SEATS_SPARE_BLOCKS = 16

ARRIVAL, FAIR, VLLM = "kvledger-arrival", "kvledger-fair", "vllm"
HEADROOM_SYS, NO_HEADROOM, VLLM_PRIORITY = "kvledger-headroom", "kvledger-priority", "vllm-priority"
SEATS_ARRIVAL, SEATS_FAIR, SEATS_VLLM = "kvledger-arrival-seats", "kvledger-fair-seats", "vllm-seats"
LABELS = {ARRIVAL: "kvledger --no-tenant-fairness", FAIR: "kvledger (fair)", VLLM: "vLLM",
          HEADROOM_SYS: f"kvledger priority, headroom {HEADROOM}",
          NO_HEADROOM: "kvledger priority, no headroom", VLLM_PRIORITY: "vLLM priority"}
LABELS |= {SEATS_ARRIVAL: LABELS[ARRIVAL], SEATS_FAIR: LABELS[FAIR], SEATS_VLLM: LABELS[VLLM]}
# Where one flood request's service time is measured (alone, idle): the two-tenant
# workloads' judged kvledger and vLLM.
SERVICE_TIMED = frozenset({FAIR, VLLM, SEATS_FAIR, SEATS_VLLM})


@dataclass(frozen=True)
class System:
    name: str
    engine: str                  # kvledger | vllm
    pool_blocks: int             # --num-gpu-blocks-override, checked on the running server
    flags: tuple[str, ...] = ()
    max_num_seqs: int = MAX_NUM_SEQS
    ramp_s: float = RAMP_S       # the flood alone before the window opens
    staggered: bool = False      # flood clients start spread over the ramp's first half


def seats_pool_blocks(clients: int) -> int:
    """Workload 3's pool: every flood client's request at its largest, and the spare."""
    return clients * LARGEST_FLOOD_BLOCKS + SEATS_SPARE_BLOCKS


def systems_of(vllm_found: bool, plain_priority_too: bool, pool_blocks: int,
               clients: int) -> tuple[list[System], list[System], list[System]]:
    """The servers of workloads 1, 2 and 3, each in the order of a round's first half:
    workloads 1 and 2 on ``pool_blocks`` (--pool-blocks), workload 3 on SEATS seats and
    ``seats_pool_blocks(clients)``."""
    keys = ("--api-key", KEYS["flood"], KEYS["small"])
    priority = ("--scheduling-policy", "priority")
    one = [System(ARRIVAL, "kvledger", pool_blocks, (*keys, "--no-tenant-fairness")),
           System(FAIR, "kvledger", pool_blocks, keys)]
    two = [System(HEADROOM_SYS, "kvledger", pool_blocks,
                  (*keys, *priority, "--priority-headroom", HEADROOM))]
    seats = {"pool_blocks": seats_pool_blocks(clients), "max_num_seqs": SEATS,
             "ramp_s": SEATS_RAMP_S, "staggered": True}
    three = [System(SEATS_ARRIVAL, "kvledger", flags=(*keys, "--no-tenant-fairness"), **seats),
             System(SEATS_FAIR, "kvledger", flags=keys, **seats)]
    if plain_priority_too:
        two.append(System(NO_HEADROOM, "kvledger", pool_blocks, (*keys, *priority)))
    if vllm_found:
        one.append(System(VLLM, "vllm", pool_blocks))
        two.insert(1, System(VLLM_PRIORITY, "vllm", pool_blocks, priority))
        three.append(System(SEATS_VLLM, "vllm", **seats))
    return one, two, three


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
