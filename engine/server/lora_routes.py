"""LoRA adapters over HTTP, as vLLM serves them: a request names an adapter in ``model``;
``/v1/models`` lists the base model and each adapter (``parent`` the base, ``root`` its
hub uri, or its name: never a path on the server); ``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` change the set at
run time, only when ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` is true or ``kvledger serve
--allow-runtime-lora-updating`` is given (else, as in vLLM, there is no such route: 404).

Unloading an adapter refuses new requests for it (404) while those in flight finish with
the weights they started with. The adapters' metrics: vLLM's ``vllm:lora_requests_info``
(what the Gateway API Inference Extension's endpoint picker reads to route to a pod that
has an adapter loaded) and ``kvledger_lora_requests_total{adapter}``.
"""

from __future__ import annotations

import os
import time
from typing import Any

from aiohttp import web
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvledger.engine.checkpoint.hub.repo import is_hub_uri
from kvledger.engine.errors import BadInput
from kvledger.engine.server.api_errors import ApiError, bad_request
from kvledger.engine.server.limits import decode_json
from kvledger.engine.server.state import STATE, ServerState
from kvledger.engine.settings.lora_config import LoraModule

RUNTIME_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def runtime_updating_allowed(flag: bool) -> bool:
    """The kvledger flag, or vLLM's variable set to true (``1``/``true``, any case)."""
    return flag or os.environ.get(RUNTIME_ENV, "").strip().lower() in ("1", "true")


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/load_lora_adapter", load_lora_adapter)
    app.router.add_post("/v1/unload_lora_adapter", unload_lora_adapter)


def model_cards(state: ServerState) -> list[dict[str, Any]]:
    """``/v1/models``' entries: the base model's names, then every adapter."""
    served = state.served
    card = {"object": "model", "created": int(state.started_at), "owned_by": "kvledger",
            "max_model_len": served.max_model_len}
    cards = [{"id": name, **card, "root": served.model_root, "parent": None}
             for name in state.door.model_names]
    cards += [{"id": name, **card, "root": lora.lora_path if is_hub_uri(lora.lora_path)
               else name, "parent": state.model_name}
              for name, lora in served.adapters().items()]
    return cards


async def load_lora_adapter(request: web.Request) -> web.Response:
    state, body = await _runtime_request(request)
    name, path = body.get("lora_name"), body.get("lora_path")
    if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
        raise bad_request("Both 'lora_name' and 'lora_path' must be provided.", "lora_name")
    try:
        module = LoraModule(name, path)
        # Reading and checking the adapter is file (or hub) I/O and tensor work: off the
        # loop, on the adapters' own threads.
        await state.offload.load_adapter(state.served.add_adapter, module)
    except BadInput as exc:
        raise bad_request(str(exc), "lora_path") from None
    return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")


async def unload_lora_adapter(request: web.Request) -> web.Response:
    state, body = await _runtime_request(request)
    name = body.get("lora_name")
    if not isinstance(name, str) or not name:
        raise bad_request("'lora_name' needs to be provided to unload a LoRA adapter.",
                          "lora_name")
    if name not in state.served.adapters():
        raise ApiError(404, f"The lora adapter '{name}' cannot be found.",
                       code="model_not_found", param="lora_name", reason="unknown_model")
    state.served.remove_adapter(name)
    return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")


async def _runtime_request(request: web.Request) -> tuple[ServerState, dict]:
    """The state and the JSON body of a runtime update: 404 (no such route) when they are
    not allowed, 503 while loading, 400 without --enable-lora or for a body not an object."""
    state = request.app[STATE]
    if not runtime_updating_allowed(state.options.allow_runtime_lora_updating):
        raise web.HTTPNotFound()
    state.check_accepting()
    if not state.served.lora_enabled:
        raise bad_request("LoRA adapters need the engine started with --enable-lora")
    body = decode_json(await request.read())
    if not isinstance(body, dict):
        raise bad_request("the body must be a JSON object")
    return state, body


class LoraCollector:
    """``vllm:lora_requests_info`` (one sample, the current time, labelled with the
    adapters running and waiting, comma-separated with no spaces, and ``max_lora``, as
    vLLM exports it) and ``kvledger_lora_requests_total{adapter}``, read at scrape time."""

    def __init__(self, state: ServerState) -> None:
        self.state = state

    def collect(self):
        served = self.state.served
        gauges = None if served is None else served.adapter_gauges()
        if gauges is None:
            return
        info = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on lora requests.",
                                 labels=["max_lora", "running_lora_adapters",
                                         "waiting_lora_adapters"])
        info.add_metric([str(gauges.max_loras), ",".join(gauges.running),
                         ",".join(gauges.waiting)], time.time())
        yield info
        counts = CounterMetricFamily("kvledger_lora_requests", "requests admitted for each "
                                     "LoRA adapter", labels=["adapter"])
        for name, count in sorted(gauges.requests_total.items()):
            counts.add_metric([name], count)
        yield counts
