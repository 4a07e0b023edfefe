"""What the server may read of the engine it serves, beside the requests it submits: the
model's names and limits, the plan, the KV pool's gauges, the stall watch's counts, and
the adapters, which the runtime-update endpoints add and remove. The front door hands it
out (``FrontDoor.served``); the server holds nothing else of the engine, so nothing it
does reaches the pool, the line or the scheduler but through the door.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from kvledger.engine.settings.lora_config import LoraModule, LoRARequest

if TYPE_CHECKING:  # the engine pulls torch in
    from kvledger.engine.core.engine import LLMEngine


@dataclass(frozen=True)
class PoolGauges:
    """The KV pool now, as ``/v1/budget`` and ``/metrics`` show it."""

    block_size: int
    num_blocks: int
    reserved_blocks: int
    used_blocks: int
    free_blocks: int
    cached_blocks: int
    paused_reservations: int
    overcommit: bool  # --admission safe
    refused_draws: int  # steps a request sat out under --admission safe
    enable_prefix_caching: bool
    prefix_cache_queries: int
    prefix_cache_hits: int


class StallCounts(NamedTuple):
    """The engine loop's stall watch (``core/stall.py``): stuck now, and how often it was."""

    stalled: bool
    stalls: int


@dataclass(frozen=True)
class AdapterGauges:
    """``vllm:lora_requests_info`` and kvledger's per-adapter request counter."""

    max_loras: int
    running: tuple[str, ...]
    waiting: tuple[str, ...]
    requests_total: dict[str, int]


class Served:
    """One engine, as the server sees it."""

    def __init__(self, engine: LLMEngine) -> None:
        self._engine = engine

    # -- the model -----------------------------------------------------------------
    @property
    def model_name(self) -> str:
        return self._engine.model_name

    @property
    def model_root(self) -> str:
        """The model's folder or hub uri, as ``/v1/models`` names its root."""
        return self._engine.config.model

    @property
    def max_model_len(self) -> int:
        return self._engine.max_model_len

    def plan_json(self) -> dict[str, Any] | None:
        """The plan the engine runs under (None for an engine made without one)."""
        plan = self._engine.plan
        return None if plan is None else plan.to_json()

    def check_prompt_ids(self, ids: list[int]) -> None:
        """BadInput unless ``ids`` are this model's token ids (``/detokenize``'s)."""
        self._engine.check_prompt(ids)

    # -- the pool and the loop -------------------------------------------------------
    def pool(self) -> PoolGauges:
        ledger = self._engine.ledger
        overcommit = ledger.overcommit
        return PoolGauges(
            block_size=ledger.block_size, num_blocks=ledger.num_blocks,
            reserved_blocks=ledger.reserved_blocks, used_blocks=ledger.used_blocks,
            free_blocks=ledger.free_blocks, cached_blocks=ledger.cached_blocks,
            paused_reservations=ledger.paused_reservations, overcommit=bool(overcommit),
            refused_draws=overcommit.refused_draws if overcommit else 0,
            enable_prefix_caching=ledger.prefix_cache.enabled,
            prefix_cache_queries=ledger.prefix_cache.queries,
            prefix_cache_hits=ledger.prefix_cache.hits)

    def engine_stall(self) -> StallCounts:
        watch = self._engine.stall_watch
        return StallCounts(bool(watch.stalled), watch.stalls)

    def on_rank_lost(self, callback: Callable[[str], None]) -> None:
        """``callback(reason)`` when a rank other processes run is lost (none: never)."""
        ranks = getattr(self._engine.runner, "ranks", None)
        if ranks is not None:
            ranks.on_lost(callback)

    def stop_ranks(self) -> None:
        """Stop the ranks other processes run (``-tp``, ``-pp``, other machines), if any."""
        ranks = getattr(self._engine.runner, "ranks", None)
        if ranks is not None:
            ranks.stop()

    # -- the adapters ----------------------------------------------------------------
    @property
    def lora_enabled(self) -> bool:
        return self._engine.loras is not None

    def adapters(self) -> dict[str, LoRARequest]:
        """The adapters served by name, in the order they were added ({} without LoRA)."""
        loras = self._engine.loras
        return {} if loras is None else loras.served

    def add_adapter(self, module: LoraModule) -> LoRARequest:
        """Read, check and serve ``module`` (blocking: file or hub I/O, tensor work);
        BadInput for one it cannot serve."""
        return self._engine.loras.add(module)

    def remove_adapter(self, name: str) -> None:
        self._engine.loras.remove(name)

    def count_adapter_request(self, name: str) -> None:
        self._engine.loras.count(name)

    def adapter_gauges(self) -> AdapterGauges | None:
        """None without ``--enable-lora``."""
        loras = self._engine.loras
        if loras is None:
            return None
        running, waiting = self._engine.scheduler.lora_names
        return AdapterGauges(self._engine.config.max_loras, running, waiting,
                             dict(loras.requests_total))
