"""The server's own series, read at scrape time from its state (``ServerState``): the
ledger's, the admission line's (through the engine's front door), the engine loop's. ``ServerMetrics`` exports them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# The server's state (``state.ServerState``, which calls ``watch_series``: typed loosely
# here, as importing it back would make a cycle of the server's modules).
ServerState = Any


def watch_series(state: ServerState) -> None:
    """Register ``state``'s series with its ``metrics`` (each read at scrape time)."""
    pool = lambda attr: lambda: (getattr(state.served.pool(), attr)  # noqa: E731
                                 if state.served else 0)
    door = lambda attr: lambda: getattr(state.door, attr) if state.door else 0  # noqa: E731
    waiting = door("waiting")
    state.metrics.watch_tenants(state.tenants.labels, lambda: (
        state.door.waiting_by_tenant() if state.door else {}))
    state.metrics.watch({
        "kvledger_kv_blocks_total": ("KV blocks in the pool", pool("num_blocks")),
        "kvledger_kv_blocks_reserved": ("KV blocks claimed by admitted requests",
                                        pool("reserved_blocks")),
        "kvledger_kv_blocks_used": ("KV blocks held by running requests (cached blocks "
                                    "not included)", pool("used_blocks")),
        "kvledger_kv_reserved_ratio": ("share of the KV blocks claimed by admitted "
                                       "requests, 0..1", lambda: _kv_reserved_ratio(state)),
        "kvledger_requests_waiting": ("requests waiting for a reservation", waiting),
        "kvledger_queue_length": ("requests waiting for a reservation (the older name of "
                                  "kvledger_requests_waiting)", waiting),
        "kvledger_requests_running": ("admitted requests not yet finished",
                                      door("running")),
        "kvledger_requests_paused": ("requests whose next KV block was refused at the "
                                     "last step (--admission safe): they keep their "
                                     "blocks and wait", pool("paused_reservations")),
        "kvledger_engine_stalled": ("1 while the engine holds requests and none has "
                                    "progressed for a while (a bug: /health is 503)",
                                    _stall(state, "stalled")),
        "kvledger_line_stalled": ("1 while requests wait in line, the engine holds none "
                                  "and none is admitted (a bug: /health is 503)",
                                  _line_stall(state, "stalled")),
    }, counters={
        "kvledger_kv_draws_refused": ("engine steps a request sat out because its next "
                                      "KV block would have left another unable to finish "
                                      "(--admission safe)",
                                      pool("refused_draws")),
        "kvledger_prefix_cache_queries": ("prompt tokens of requests that looked up the "
                                          "prefix cache", pool("prefix_cache_queries")),
        "kvledger_prefix_cache_hits": ("prompt tokens found in the prefix cache (not "
                                       "computed again)", pool("prefix_cache_hits")),
        "kvledger_engine_stalls": ("times the engine stalled (kvledger_engine_stalled)",
                                   _stall(state, "stalls")),
        "kvledger_line_stalls": ("times the admission line stalled (kvledger_line_stalled)",
                                 _line_stall(state, "stalls")),
        "kvledger_engine_steps": ("engine steps that produced tokens", _driver(state, "steps")),
        "kvledger_engine_step_seconds": ("wall time of the engine steps that produced "
                                         "tokens", _driver(state, "step_seconds")),
        "kvledger_engine_step_tokens": ("tokens those steps produced, one per sequence "
                                        "given one", _driver(state, "step_tokens")),
        "kvledger_requests_backfilled": ("requests admitted ahead of the line (--backfill): "
                                         "they start now and delay the plans of none "
                                         "of the first in line",
                                         door("backfilled")),
    }, model_name=lambda: state.served.model_name if state.served else None)


def _stall(state: ServerState, attr: str) -> Callable[[], float]:
    return lambda: getattr(state.served.engine_stall(), attr) if state.served else 0


def _line_stall(state: ServerState, attr: str) -> Callable[[], float]:
    return lambda: getattr(state.door.line_watch, attr) if state.door else 0


def _driver(state: ServerState, attr: str) -> Callable[[], float]:
    return lambda: getattr(state.door.driver, attr) if state.door and state.door.driver else 0


def _kv_reserved_ratio(state: ServerState) -> float:
    if state.served is None:
        return 0.0
    pool = state.served.pool()
    return pool.reserved_blocks / pool.num_blocks
