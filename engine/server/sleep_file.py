"""Sleep driven by a file (``--sleep-level-file``): the level the engine should be at,
as the operator's ``spec.sleep`` puts it in a mounted ConfigMap (the kubelet rewrites the
file in place when the ConfigMap changes, within its sync period).

The file is read every ``POLL_S``; each change of its text is acted on once, as ``POST
/sleep?level=N`` (waiting for what is admitted; the door closed meanwhile) or ``POST
/wake_up`` would (asleep at another level: woken first). Acting on changes alone leaves the
HTTP endpoints their say in between. A text that is no level is logged and ignored; a
missing or empty file means awake.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from kvledger.engine.errors import BadInput
from kvledger.engine.frontend.sleeping import SleepGate

log = logging.getLogger(__name__)
POLL_S = 1.0
LEVELS = ("0", "1", "2")
AWAKE = ("", "awake")


def wanted_level(text: str) -> int | None:
    """The level a file's text names (None: awake); BadInput for any other text."""
    text = text.strip().lower()
    if text in AWAKE:
        return None
    if text in LEVELS:
        return int(text)
    raise BadInput(f"{text[:40]!r} is no sleep level (0, 1 or 2; empty: awake)")


MAX_BYTES = 64  # a level is one character; more is read no further


def _read(path: Path) -> str:
    try:
        with path.open("rb") as f:
            return f.read(MAX_BYTES).decode("utf-8", errors="replace")
    except OSError:  # absent (not mounted yet, or removed): awake
        return ""


async def follow(gate: SleepGate, path: Path, on_change=None, poll_s: float = POLL_S) -> None:
    """Act on each change of ``path``'s text until cancelled; ``on_change(level)`` after
    each sleep or wake (the metrics' gauge)."""
    seen: str | None = None
    while True:
        text = _read(path)
        if text != seen:
            seen = text
            try:
                await _converge(gate, wanted_level(text), on_change)
            except BadInput as exc:
                log.warning("%s: %s; the engine stays as it is", path, exc)
            except Exception:  # a failed sleep or wake: logged, the next change tries again
                log.exception("%s: acting on %r failed", path, text.strip())
        await asyncio.sleep(poll_s)


async def _converge(gate: SleepGate, wanted: int | None, on_change) -> None:
    if wanted == gate.level:
        return
    if gate.level is not None:
        awake = await gate.wake()
        log.info("awake (%s)", "all" if awake else "partly")
        if on_change is not None:
            on_change(None if awake else gate.level)
        if not awake:
            return
    if wanted is not None:
        freed_s = await gate.sleep(wanted)
        log.info("sleeping at level %d (%.3f s to free), as the sleep file says", wanted, freed_s)
        if on_change is not None:
            on_change(wanted)
