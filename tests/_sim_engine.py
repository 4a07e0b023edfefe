"""The real engine loop (``LLMEngine.step``, ``Scheduler``, ``KVLedger``) with only the
forward pass faked, for tests of scheduling and admission that run thousands of steps:
``sim_engine`` builds one, ``submit`` admits a request as the server does (reserve every
choice, then hand each to the engine), and ``brute_force_safe`` checks the ledger's state
by trying every completion order, sharing no code with ``engine/kv/safety.py``."""

from __future__ import annotations

import random
from dataclasses import dataclass
from functools import cache, lru_cache
from types import SimpleNamespace

import torch

from kvledger.engine.core.engine import LLMEngine
from kvledger.engine.core.request import EngineRequest
from kvledger.engine.core.runner import StepOutput
from kvledger.engine.core.scheduler import ScheduledBatch, Scheduler
from kvledger.engine.kv.ledger import KVLedger
from kvledger.engine.model.tokenizer import Tokenizer
from kvledger.engine.sampling.params import SamplingParams
from kvledger.engine.settings.config import EngineConfig


@dataclass(frozen=True, eq=False)
class Adapter:
    """Stands in for a loaded LoRA adapter: the scheduler and the ledger only need its
    identity (one slot per object) and its name and id (its prefix-cache salt)."""

    name: str
    lora_int_id: int


class FakeRunner:
    """Returns logits that pick a random token, EOS with probability ``eos_rate``; records
    each batch it ran (``batches``), so a test sees which steps computed tokens."""

    def __init__(self, vocab_size: int, eos_token_id: int, eos_rate: float, seed: int) -> None:
        self.config = SimpleNamespace(vocab_size=vocab_size)
        self.device = torch.device("cpu")
        self.lora = None
        self.eos_token_id = eos_token_id
        self.eos_rate = eos_rate
        self.rng = random.Random(seed)
        self.batches: list[ScheduledBatch] = []

    def execute(self, batch: ScheduledBatch) -> StepOutput:
        self.batches.append(batch)
        rows = len(batch.sampled)
        logits = torch.zeros(rows, self.config.vocab_size)
        for row in range(rows):
            eos = self.rng.random() < self.eos_rate
            token = self.eos_token_id if eos else self.rng.randrange(10, self.config.vocab_size)
            logits[row, token] = 1.0
        return StepOutput(logits, {})


@lru_cache(maxsize=4)
def _tokenizer(model_dir: str) -> Tokenizer:
    return Tokenizer(model_dir)


def sim_engine(model_dir, *, num_blocks: int, block_size: int, max_num_seqs: int,
               max_num_batched_tokens: int, max_loras: int | None = None,
               prefix_caching: bool = True, admission: str = "safe", max_model_len: int = 4096,
               eos_rate: float = 0.0, seed: int = 0, priority_headroom: float = 0.0
               ) -> LLMEngine:
    """An engine over ``model_dir``'s tokenizer whose forward pass is a ``FakeRunner``:
    every other part (admission, ledger, scheduler, sampler, postprocessing) is the real
    one, built as ``core/startup.py`` builds it. ``priority_headroom``: under the priority
    policy, that share kept for requests of priority <= 0."""
    tokenizer = _tokenizer(str(model_dir))
    ledger = KVLedger(num_blocks, block_size, enable_prefix_caching=prefix_caching,
                      overcommit=admission == "safe", max_live=max_num_seqs,
                      max_adapters=max_loras)
    plan = SimpleNamespace(max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                           max_num_batched_tokens=max_num_batched_tokens)
    runner = FakeRunner(tokenizer.vocab_size, min(tokenizer.eos_token_ids), eos_rate, seed)
    policy = "priority" if priority_headroom else "fcfs"
    engine = LLMEngine(EngineConfig(model=str(model_dir), device="cpu", seed=seed,
                                    scheduling_policy=policy,
                                    priority_headroom=priority_headroom), plan,
                       tokenizer, runner, ledger)
    engine.scheduler = Scheduler(ledger, max_num_seqs, max_num_batched_tokens, max_loras,
                                 engine.headroom)
    engine.intake.scheduler = engine.scheduler  # the one its adds and aborts go to
    return engine


def submit(engine: LLMEngine, request_id: str, prompt: list[int], cap: int, *, n: int = 1,
           adapter: Adapter | None = None, ignore_eos: bool = True,
           priority: int = 0) -> list[str] | None:
    """Admit a request of ``n`` choices as the server does (all reserved at once, then
    each handed to the engine); their ids, or None when the ledger refuses it now (at
    ``priority``, without the engine's headroom unless it may take it)."""
    params = SamplingParams(temperature=0, max_tokens=cap, ignore_eos=ignore_eos)
    request = EngineRequest(list(prompt), params, cap, adapter, priority)
    reservations = engine.ledger.try_reserve_each(request.num_tokens, n, request.prompt_token_ids,
                                                  salt=request.lora_salt, adapter=adapter,
                                                  kept=engine.headroom.kept_from(priority))
    if reservations is None:
        return None
    ids = [request_id if n == 1 else f"{request_id}-{i}" for i in range(n)]
    for choice_id, reservation in zip(ids, reservations, strict=True):
        engine.add_request(choice_id, request, reservation=reservation)
    return ids


def brute_force_safe(engine: LLMEngine) -> bool:
    """Whether every live request can reach its cap in some order, found by trying every
    order (memoised on the set already finished). A request needs ``num_blocks`` minus
    the blocks it holds (a choice awaiting its prompt may have to compute it); it finds
    the unused blocks (free or cached) plus every held block whose holders have all
    finished; one not running also needs a free seat and, for an adapter no running
    request uses, a free slot. Seats, slots and holders are read from the scheduler's
    sequences and the blocks' lists, not from the ledger's bookkeeping."""
    ledger, scheduler = engine.ledger, engine.scheduler
    seqs = [*scheduler.running.values(), *scheduler.waiting, *engine.intake.pending_adds.values()]
    live = [s for s in seqs if not s.reservation.released]
    holders: dict[int, set[int]] = {}
    for i, seq in enumerate(live):
        for block in seq.reservation.block_ids:
            holders.setdefault(block, set()).add(i)
    pool = ledger._pool
    unused = ledger.num_blocks - pool.num_in_use
    needs = [s.reservation.num_blocks - len(s.reservation.block_ids) for s in live]
    running = [s.request_id in scheduler.running for s in live]
    seats, slots = scheduler.max_num_seqs, scheduler.max_loras

    @cache
    def finishes(done: frozenset[int]) -> bool:
        if len(done) == len(live):
            return True
        back = sum(1 for block, held in holders.items()
                   if held <= done and pool.ref_counts[block] == len(held))
        busy = [i for i in range(len(live)) if running[i] and i not in done]
        adapters = {id(live[i].lora) for i in busy if live[i].lora is not None}
        for i in range(len(live)):
            if i in done or needs[i] > unused + back:
                continue
            seq = live[i]
            if not running[i] and (len(busy) >= seats or (
                    slots is not None and seq.lora is not None
                    and id(seq.lora) not in adapters and len(adapters) >= slots)):
                continue
            if finishes(done | {i}):
                return True
        return False

    return finishes(frozenset())
