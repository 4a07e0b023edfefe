"""vLLM's sleep-mode endpoints, served as vLLM 0.32 serves them: only in its development
mode (``VLLM_SERVER_DEV_MODE=1``), here behind the API key too, and only with
``--enable-sleep-mode`` (else 400 naming the flag).

- ``POST /sleep?level=0|1|2[&mode=wait|keep]``: ``{"status": "sleeping", "level": N}``
  once everything admitted has finished and the memory is freed (``mode=abort``, vLLM's
  default, is refused: kvledger never drops an admitted request);
- ``POST /wake_up[?tags=weights&tags=kv_cache]``: ``{"status": "awake"|"sleeping",
  "tags": [...]|null}``;
- ``GET /is_sleeping``: ``{"is_sleeping": bool}``.

While asleep (and while waking) requests get 503 with a Retry-After of the predicted wake
time, ``/ready`` answers 503 ``sleeping`` (a load balancer sends nothing) and
``vllm:engine_sleep_state`` says which level.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable
from typing import TypeVar

from aiohttp import web

from kvledger.engine.frontend.sleeping import SleepGate
from kvledger.engine.server.api_errors import ApiError, bad_request, engine_error
from kvledger.engine.server.state import STATE

log = logging.getLogger(__name__)
PATHS = ("/sleep", "/wake_up", "/is_sleeping")
T = TypeVar("T")


def add_sleep_routes(app: web.Application) -> None:
    app.router.add_post("/sleep", sleep)
    app.router.add_post("/wake_up", wake_up)
    app.router.add_get("/is_sleeping", is_sleeping)


def _gate(request: web.Request) -> SleepGate:
    door = request.app[STATE].check_accepting()
    if door.sleep is None:
        raise ApiError(400, "sleep mode is off: serve with --enable-sleep-mode",
                       code="sleep_mode_off")
    return door.sleep


async def sleep(request: web.Request) -> web.Response:
    gate = _gate(request)
    text = request.query.get("level", "1")
    if not text.isdigit():
        raise bad_request(f"level={text!r}: vLLM's sleep levels are 0, 1 and 2", "level")
    level = int(text)
    freed_s = await _answered(gate.sleep(level, request.query.get("mode")))
    request.app[STATE].metrics.sleep_state(level)
    log.info("sleeping at level %d (%.3f s to free)", level, freed_s)
    return web.json_response({"status": "sleeping", "level": level})


async def wake_up(request: web.Request) -> web.Response:
    gate = _gate(request)
    tags = request.query.getall("tags", []) or None
    awake = await _answered(gate.wake(tags))
    request.app[STATE].metrics.sleep_state(None if awake else gate.level)
    return web.json_response({"status": "awake" if awake else "sleeping", "tags": tags})


async def _answered(call: Awaitable[T]) -> T:
    """``call``'s result; its BadInput (a level, mode or tag vLLM does not have, a sleep
    on a sleeping engine) as the 400 naming the parameter."""
    try:
        return await call
    except Exception as exc:
        error = engine_error(exc)
        if error is None:
            raise
        raise error from None


async def is_sleeping(request: web.Request) -> web.Response:
    return web.json_response({"is_sleeping": _gate(request).is_sleeping})
