"""``LineOptions``: how a front door's admission line behaves and compiles constraints."""

from __future__ import annotations

from dataclasses import dataclass

from kvledger.engine.settings.serve_config import ServeConfig
from kvledger.engine.settings.structured_outputs_config import StructuredOutputsConfig


@dataclass(frozen=True)
class LineOptions:
    """How the door's admission line behaves (the server's ``--max-queue-*`` flags) and
    how it compiles constraints; the defaults are ``LLM``'s: no cap on the line nor on the
    wait, vLLM's structured outputs defaults."""

    max_queue_wait_s: float | None = None  # None: a waiter waits as long as it takes
    max_queue_len: int | None = None        # None: no cap
    backfill: bool = False                  # later requests may go before the head
    tenant_fairness: bool = ServeConfig.tenant_fairness  # the line takes turns
    grammar_compile_timeout_s: float | None = None  # None: as long as it takes
    structured_outputs: StructuredOutputsConfig = StructuredOutputsConfig()  # noqa: RUF009
