"""The validating admission webhook: ``kubectl apply`` refuses an InferenceService that fits
no node it may run on, with the planner's breakdown, before a pod is made.

kopf serves it (``@kopf.on.validate``, its ``WebhookServer`` over TLS) at ``/validate``
when ``kvledger operator --webhook-port`` is given; the chart renders the
ValidatingWebhookConfiguration and its Service (``charts/kvledger``, ``webhook:``). The
verdict is ``fit.judge``'s, on:

- the spec as the operator parses it (an invalid spec or one the admin's policy forbids is
  refused too, with the message ``kubectl describe`` would show later);
- the cluster's GPU nodes, kept by a kopf index from a watch of the Nodes (no list per
  request);
- the model: a hub model's config.json and safetensors headers, read as the pre-flight reads
  them, at the endpoint the admin allows, with no token, within the webhook's deadline. Past
  the deadline it is allowed with a warning and the read goes on, so that a re-apply is
  answered from memory (``ModelCache``: by endpoint and uri, ten minutes for a branch or
  tag, for as long as it is used for a commit). A model in a volume cannot be read here.

An UPDATE that leaves the spec as it was (kopf's own annotations, finalizers, labels) is
let through at once: the operator must always be able to write to its resources.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kopf

from kvledger.engine.checkpoint.contents import ModelShape, ModelSource, WeightsInfo
from kvledger.engine.checkpoint.hub.headers import header_mirror
from kvledger.engine.checkpoint.model_config import ModelConfig
from kvledger.engine.cli import build_parser
from kvledger.engine.config import EngineConfig, config_from_args
from kvledger.engine.errors import BadInput
from kvledger.engine.planner.plan import make_plan, read_checkpoint
from kvledger.engine.planner.record import Plan
from kvledger.operator import fit, inventory
from kvledger.operator.policy import PolicyDenied
from kvledger.operator.render import engine_flags
from kvledger.operator.resource import GROUP, PLURAL, VERSION
from kvledger.operator.spec import ServiceSpec, parse_spec

WEBHOOK_ID = "validate"  # kopf serves a handler at /<its id>: the chart's clientConfig path
INDEX = "gpu_nodes"
# What the deadline keeps back for planning and the answer's way back to the API server.
ANSWER_MARGIN_S = 2.0
BRANCH_TTL_S = 600.0
CACHED_MODELS = 64
CACHED_PLANS = 512
HUB_THREADS = 4  # hub reads at once; more wait their turn (and their deadline)
PLAN_THREADS = 2
_COMMIT = re.compile(r"@[0-9a-f]{40}$")


@dataclass(frozen=True)
class Headers:
    """A hub model as the planner reads it, or why the pre-flight refuses it (``refused``)."""

    shape: ModelShape | None = None
    weights: WeightsInfo | None = None
    source: ModelSource | None = None
    refused: str | None = None


class HubUnavailable(Exception):
    """The hub did not answer with the model's files now (one line, no token)."""


def read_headers(uri: str, endpoint: str, timeout_s: float) -> Headers:
    """What the pre-flight reads of ``uri`` (blocking): Headers, refused when the model
    itself is bad; HubUnavailable when the hub is."""
    entered = False
    try:
        with header_mirror(uri, endpoint=endpoint, timeout_s=timeout_s) as source:
            entered = True
            shape, weights = read_checkpoint(source.path)
            ModelConfig.from_dir(source.path)  # what the engine cannot run, refused alike
            return Headers(shape, weights, ModelSource("", uri=source.uri, commit=source.commit))
    except BadInput as exc:
        if entered:
            return Headers(refused=str(exc))
        raise HubUnavailable((str(exc).strip().splitlines() or ["no answer"])[0]) from None
    except OSError as exc:
        raise HubUnavailable(str(exc.strerror or exc)) from None


class ModelCache:
    """Hub models' headers by (endpoint, uri); one read in flight per key, on threads of its
    own: a flood of applies naming new models queues here, never on the threads the
    operator's reconcile uses (asyncio's default pool)."""

    def __init__(self, read: Callable[[str, str, float], Headers] = read_headers,
                 threads: int = HUB_THREADS) -> None:
        self._read = read
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="kvledger-webhook-hub")
        self._entries: OrderedDict[tuple[str, str], tuple[float, Headers]] = OrderedDict()
        self._pending: dict[tuple[str, str], asyncio.Future[Headers]] = {}

    async def get(self, uri: str, endpoint: str, within_s: float) -> Headers:
        """The headers, read now when not kept; TimeoutError past ``within_s`` (the read goes
        on and is kept), HubUnavailable when the hub fails."""
        key = (endpoint, uri)
        kept = self._entries.get(key)
        if kept is not None and kept[0] > time.monotonic():
            self._entries.move_to_end(key)
            return kept[1]
        pending = self._pending.get(key)
        if pending is None:
            pending = asyncio.get_running_loop().run_in_executor(
                self._pool, self._read, uri, endpoint, max(within_s, 30.0))
            self._pending[key] = pending
            pending.add_done_callback(lambda done: self._keep(key, done))
        return await asyncio.wait_for(asyncio.shield(pending), within_s)

    def _keep(self, key: tuple[str, str], done: asyncio.Future[Headers]) -> None:
        self._pending.pop(key, None)
        if done.cancelled() or done.exception() is not None:
            return  # the hub failed: asked again next time
        ttl = float("inf") if _COMMIT.search(key[1]) else BRANCH_TTL_S
        self._entries[key] = (time.monotonic() + ttl, done.result())
        while len(self._entries) > CACHED_MODELS:
            self._entries.popitem(last=False)


@functools.cache
def _preflight_parser():
    return build_parser("preflight")  # built once: it declares every flag


def preflight_config(flags: list[str]) -> EngineConfig:
    """The config the pre-flight container builds from these args (its own parser)."""
    return config_from_args(_preflight_parser().parse_args(flags))


class Webhook:
    """The verdict's state: the model and plan caches, the deadline and the mode."""

    def __init__(self, *, timeout_s: float = 10.0, refuse: bool = True,
                 models: ModelCache | None = None) -> None:
        self.timeout_s = timeout_s
        self.refuse = refuse
        self.models = models or ModelCache()
        self._plans: OrderedDict[tuple[Any, ...], Plan] = OrderedDict()
        self._plans_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(PLAN_THREADS, thread_name_prefix="kvledger-webhook-plan")

    async def verdict(self, name: str, spec: ServiceSpec, nodes: list[Mapping[str, Any]],
                      hub_endpoint: str) -> fit.Verdict:
        plan_on, unread = None, None
        uri = spec.model.uri
        if spec.gpus == 0:
            pass  # planned in the pod against its own memory limit
        elif uri is None:
            unread = (f"the model at {spec.model.path} is on the pod's volume, which the "
                      "operator does not read")
        elif spec.model.token_secret is not None:
            unread = (f"{uri} is read with the token of spec.model.tokenSecretRef, which the "
                      "operator does not read")
        else:
            within = max(1.0, self.timeout_s - ANSWER_MARGIN_S)
            try:
                headers = await self.models.get(uri, hub_endpoint, within)
            except TimeoutError:
                unread = (f"reading the headers of {uri} took over {within:.0f} s (the "
                          "webhook's deadline); the read goes on, and a re-apply is answered "
                          "from memory")
            except HubUnavailable as exc:
                unread = f"cannot read the headers of {uri} now: {exc}"
            else:
                if headers.refused is not None:  # the pre-flight exits 2 on it
                    raise BadInput(headers.refused)
                plan_on = self._planner(spec, headers)
        return await asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(
            fit.judge, name, spec, nodes, plan_on=plan_on, unread=unread, refuse=self.refuse))

    def _planner(self, spec: ServiceSpec, headers: Headers) -> Callable[[int], Plan]:
        flags = engine_flags(spec)

        def plan_on(memory_bytes: int) -> Plan:
            key = (headers.source, tuple(flags), memory_bytes)
            with self._plans_lock:  # the plan threads share the cache
                plan = self._plans.get(key)
            if plan is None:
                config = preflight_config([*flags, "--device-memory", str(memory_bytes)])
                plan = make_plan(config, shape=headers.shape, weights=headers.weights,
                                 source=headers.source)
                with self._plans_lock:
                    self._plans[key] = plan
                    while len(self._plans) > CACHED_PLANS:
                        self._plans.popitem(last=False)
            return plan

        return plan_on


def gpu_nodes(body: kopf.Body, **_: Any) -> dict[str, dict[str, Any]] | None:
    """The node index: each node with GPUs a pod may request, as ``inventory`` reads it."""
    entry = inventory.node_entry(body)
    return {"gpu": entry} if entry["gpus"] > 0 else None


async def validate(body: kopf.Body, old: kopf.Body | None, operation: str, memo: kopf.Memo,
                   warnings: list[str], gpu_nodes: kopf.Index, logger: logging.Logger,
                   **_: Any) -> None:
    """kopf's validating handler: AdmissionError refuses, ``warnings`` reach kubectl.

    A fault of the webhook's own lets the resource in with a warning (and a log line), as
    ``failurePolicy: Ignore`` does when it cannot be reached: only a verdict refuses."""
    spec_raw = dict(body.get("spec") or {})
    if operation == "UPDATE" and old is not None and dict(old.get("spec") or {}) == spec_raw:
        return
    meta = body.get("metadata") or {}
    if meta.get("deletionTimestamp"):
        return
    name = meta.get("name") or f"{meta.get('generateName', '')}<generated>"
    try:
        spec = parse_spec(spec_raw)
        memo.policy.check(spec, memo.default_image)
    except PolicyDenied as exc:
        raise kopf.AdmissionError(f"{name}: {exc}", code=403) from None
    except BadInput as exc:
        raise kopf.AdmissionError(f"{name}: invalid spec: {exc}", code=422) from None
    nodes = list(gpu_nodes.get("gpu", ()))
    try:
        verdict = await memo.webhook.verdict(name, spec, nodes, memo.policy.hub_endpoint(spec))
    except BadInput as exc:  # the pre-flight exits 2 on it: refused alike
        raise kopf.AdmissionError(f"{name}: {exc}", code=422) from None
    except Exception as exc:  # a fault here must not refuse the resource
        logger.exception(f"the webhook could not judge {name}")
        warnings.append(f"the webhook could not plan {name} ({type(exc).__name__}): the pod's "
                        "pre-flight checks the fit")
        return
    warnings.extend(verdict.warnings)
    if not verdict.allowed:
        raise kopf.AdmissionError(verdict.message, code=403)


def register(registry: kopf.OperatorRegistry) -> None:
    """The node index and the validating handler, in ``registry`` (only with a webhook:
    kopf refuses to start with admission handlers and no server)."""
    kopf.index("nodes", id=INDEX, registry=registry)(gpu_nodes)
    kopf.on.validate(GROUP, VERSION, PLURAL, id=WEBHOOK_ID, operations=["CREATE", "UPDATE"],
                     side_effects=False, registry=registry)(validate)


def server(port: int, cert: Path, key: Path, ca: bytes | None = None) -> kopf.WebhookServer:
    """kopf's HTTPS server on every interface; it reloads the files when they change."""
    return kopf.WebhookServer(addr="0.0.0.0", port=port, certfile=str(cert), pkeyfile=str(key),
                              cadata=ca)

