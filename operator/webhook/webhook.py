"""The validating admission webhook: ``kubectl apply`` refuses an InferenceService that fits
no node it may run on, with the planner's breakdown, before a pod is made.

kopf runs it (``@kopf.on.validate``) behind the operator's own HTTPS server
(``webhook_server``: its limits on slow clients, connections and bodies, the
AdmissionReview contract, the deadline) at ``/validate`` when ``kvledger operator
--webhook-port`` is given; the chart renders the ValidatingWebhookConfiguration and its
Service (``charts/kvledger``, ``webhook:``). The verdict is ``fit.judge``'s, on:

- the spec as the operator parses it (an invalid spec or one the admin's policy forbids is
  refused too, with the message ``kubectl describe`` would show later), and the name, which
  must be able to name the Service (``names``);
- the requester's right to read each Secret, ConfigMap and claim the spec names, asked of the API
  server (``access_review``: the pods would read them on the requester's behalf);
- the cluster's GPU nodes, kept by a kopf index from a watch of the Nodes (no list per
  request);
- the model: a hub model's config.json and safetensors headers, read as the pre-flight reads
  them, at the endpoint the admin allows, with no token, within the operator's limits and
  the review's deadline (``hub_models``). Past the deadline it is allowed with a warning
  and the read goes on, so that a re-apply is answered from memory. A model in a volume
  cannot be read here.

Every review is answered by its deadline (``webhook_server.ANSWER_BY``): one that cannot be
planned in time is allowed with a warning. What needs no planning (``gpus: 0``, a model
it cannot read, plans it made before) is judged at once on the event loop; only new plans
wait for the planning threads, in a bounded queue, so a cheap review never waits behind
expensive ones. An UPDATE that leaves the spec as it was (kopf's own annotations,
finalizers, labels) is let through at once: the operator must always be able to write to
its resources.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import kopf

from kvledger.engine.cli import build_parser
from kvledger.engine.errors import BadInput
from kvledger.engine.planner.plan import make_plan
from kvledger.engine.planner.record import Plan
from kvledger.engine.settings.config import EngineConfig
from kvledger.engine.settings.config_flags import config_from_args
from kvledger.operator.api.names import check_name
from kvledger.operator.api.resource import GROUP, PLURAL, VERSION
from kvledger.operator.api.spec import ServiceSpec, parse_spec
from kvledger.operator.cluster.hub_models import Headers, HubModels, HubUnavailable
from kvledger.operator.cluster.workers import Busy, Workers
from kvledger.operator.render.policy import PolicyDenied
from kvledger.operator.render.render import engine_flags
from kvledger.operator.webhook import access_review, fit, inventory
from kvledger.operator.webhook.webhook_server import ANSWER_BY, WebhookServer, answer_margin_s

WEBHOOK_ID = "validate"  # the path the server answers: the chart's clientConfig path
INDEX = "gpu_nodes"
# What the answer keeps back for planning after a hub read (a quarter of a timeout under
# 4 s): the hub is waited for until the deadline less this and the answer's margin.
PLAN_RESERVE_S = 1.0
CACHED_PLANS = 512
# Planning is pure Python: a second thread adds no speed under the GIL, only contention
# with the event loop the cheap reviews are answered on.
PLAN_THREADS = 1
PLAN_WAITING = 16
# How often CPython hands the GIL from thread to thread (its default: 5 ms). The event
# loop answering reviews shares it with the planning and hub threads, and each review takes
# dozens of hand-overs (every socket read and write): at 5 ms a cheap review waited 1-2 s
# behind a flood of plans on 2 cores, at 1 ms 0.5 s (bench/hostile_cluster.py).
SWITCH_INTERVAL_S = 0.001
# What a refusal of ``access_review``'s adds: why, and what to do.
READ_ONLY_YOURS = ("(a resource may name only the Secrets, ConfigMaps and claims its author "
                   "may read: ask for get on it, or have someone who may read it set the field)")


class _NotKept(Exception):
    """A plan the verdict needs has not been made yet."""


@functools.cache
def _preflight_parser():
    return build_parser("preflight")  # built once: it declares every flag


def preflight_config(flags: list[str]) -> EngineConfig:
    """The config the pre-flight container builds from these args (its own parser)."""
    return config_from_args(_preflight_parser().parse_args(flags))


class Webhook:
    """The verdict's state: the hub models and the plans made, the deadline and the mode."""

    def __init__(self, *, timeout_s: float = 10.0, refuse: bool = True,
                 models: HubModels | None = None) -> None:
        self.timeout_s = timeout_s
        self.refuse = refuse
        self.models = models or HubModels()
        self._plans: OrderedDict[tuple[Any, ...], Plan] = OrderedDict()
        self._plans_lock = threading.Lock()
        self.planning = Workers("kvledger-webhook-plan", PLAN_THREADS, PLAN_WAITING)
        sys.setswitchinterval(SWITCH_INTERVAL_S)

    async def verdict(self, name: str, spec: ServiceSpec, nodes: list[Mapping[str, Any]],
                      hub_endpoint: str, answer_by: float | None = None) -> fit.Verdict:
        """The verdict, by ``answer_by`` (a ``time.monotonic()``; default: the deadline less
        its margin from now): allowed with a warning when it cannot be planned by then."""
        if answer_by is None:
            answer_by = time.monotonic() + self.timeout_s - answer_margin_s(self.timeout_s)
        judge = functools.partial(fit.judge, name, spec, nodes, refuse=self.refuse)
        uri, headers = spec.model.uri, None
        if spec.gpus == 0:
            return judge(plan_on=None)  # planned in the pod against its own memory limit
        if uri is None:
            unread = (f"the model at {spec.model.path} is on the pod's volume, which the "
                      "operator does not read")
        elif spec.model.token_secret is not None:
            unread = (f"{uri} is read with the token of spec.model.tokenSecretRef, which the "
                      "operator does not read")
        else:
            headers, unread = await self._headers(uri, hub_endpoint, answer_by)
        if headers is None:
            return judge(plan_on=None, unread=unread)
        try:  # the plans made before: judged here, at once
            return judge(plan_on=self._planner(spec, headers, kept_only=True))
        except _NotKept:
            pass
        try:
            planned = self.planning.submit(
                lambda: judge(plan_on=self._planner(spec, headers)), start_by=answer_by)
            return await asyncio.wait_for(asyncio.shield(planned),
                                          answer_by - time.monotonic())
        except (Busy, TimeoutError, asyncio.CancelledError):
            if asyncio.current_task().cancelling():
                raise
            return fit.Verdict(True, warnings=(
                f"{name} could not be planned within the webhook's deadline "
                f"({self.planning.waiting} reviews wait to be planned): the pod's pre-flight "
                "checks the fit",))

    async def _headers(self, uri: str, endpoint: str,
                       answer_by: float) -> tuple[Headers | None, str | None]:
        """The model's headers, or why it is not planned here; BadInput when the
        pre-flight refuses the model itself."""
        within = answer_by - min(PLAN_RESERVE_S, self.timeout_s / 4) - time.monotonic()
        try:
            headers = await self.models.headers(uri, endpoint, max(0.1, within))
        except TimeoutError:
            return None, (f"reading the headers of {uri} took over {max(0.1, within):.0f} s "
                          "(the webhook's deadline); the read goes on, and a re-apply is "
                          "answered from memory")
        except HubUnavailable as exc:
            return None, f"cannot read the headers of {uri} now: {exc}"
        if headers.refused is not None:  # the pre-flight exits 2 on it
            raise BadInput(headers.refused)
        if headers.unread is not None:
            return None, headers.unread
        return headers, None

    def _planner(self, spec: ServiceSpec, headers: Headers,
                 kept_only: bool = False) -> Callable[[int], Plan]:
        """``plan_on(memory_bytes)`` for ``fit.judge``: the plans made before, and new ones
        (made and kept) unless ``kept_only``, when a new one raises _NotKept."""
        flags = engine_flags(spec)

        def plan_on(memory_bytes: int) -> Plan:
            key = (headers.source, tuple(flags), memory_bytes)
            with self._plans_lock:  # the plan threads share the cache
                plan = self._plans.get(key)
            if plan is None:
                if kept_only:
                    raise _NotKept()
                config = preflight_config([*flags, "--device-memory", str(memory_bytes)])
                plan = make_plan(config, shape=headers.shape, weights=headers.weights,
                                 source=headers.source)
                with self._plans_lock:
                    self._plans[key] = plan
                    self._keep_plans()
            return plan

        return plan_on

    def _keep_plans(self) -> None:
        """At most ``CACHED_PLANS``, and only of models the hub reads keep: a plan holds its
        model's records, so one of a model dropped there would keep them alive (under the
        plans lock)."""
        kept = self.models.kept()
        for key in [key for key in self._plans if key[0] not in kept]:
            del self._plans[key]
        while len(self._plans) > CACHED_PLANS:
            self._plans.popitem(last=False)

    def close(self) -> None:
        """Drop what waits for a planning thread (SIGTERM)."""
        self.planning.close()


def gpu_nodes(body: kopf.Body, **_: Any) -> dict[str, dict[str, Any]] | None:
    """The node index: each node with GPUs a pod may request, as ``inventory`` reads it."""
    entry = inventory.node_entry(body)
    return {"gpu": entry} if entry["gpus"] > 0 else None


async def validate(body: kopf.Body, old: kopf.Body | None, operation: str, memo: kopf.Memo,
                   warnings: list[str], gpu_nodes: kopf.Index, logger: logging.Logger,
                   namespace: str | None = None, userinfo: Mapping[str, Any] | None = None,
                   **_: Any) -> None:
    """kopf's validating handler: AdmissionError refuses, ``warnings`` reach kubectl.

    A fault of the webhook's own lets the resource in with a warning (and a log line), as
    ``failurePolicy: Ignore`` does when it cannot be reached: only a verdict refuses. The
    one exception is the check that the requester may read the Secrets and ConfigMaps the
    spec names (``access_review``), which refuses what it cannot confirm."""
    spec_raw = dict(body.get("spec") or {})
    old_spec = dict(old.get("spec") or {}) if operation == "UPDATE" and old is not None \
        else None
    if old_spec == spec_raw:
        return
    meta = body.get("metadata") or {}
    if meta.get("deletionTimestamp"):
        return
    name = meta.get("name") or f"{meta.get('generateName', '')}<generated>"
    try:
        # The children are named after it: a name the Service cannot take is refused before
        # any pod starts (an API server older than CEL validation lets it through the CRD).
        check_name(meta.get("name"), meta.get("generateName"))
        spec = parse_spec(spec_raw)
        memo.policy.check(spec, memo.default_image, name=meta.get("name"),
                          namespace=meta.get("namespace") or namespace)
    except PolicyDenied as exc:
        raise kopf.AdmissionError(f"{name}: {exc}", code=403) from None
    except BadInput as exc:
        raise kopf.AdmissionError(f"{name}: invalid spec: {exc}", code=422) from None
    answer_by = ANSWER_BY.get(None)
    if refs := access_review.to_confirm(spec_raw, old_spec):
        within_s = ((answer_by - time.monotonic()) if answer_by is not None
                    else memo.webhook.timeout_s - answer_margin_s(memo.webhook.timeout_s))
        refused = await access_review.refusals(
            memo.kube, userinfo, meta.get("namespace") or namespace or "", refs, within_s)
        if refused:
            raise kopf.AdmissionError(f"{name}: {'; '.join(refused)} {READ_ONLY_YOURS}",
                                      code=403)
    nodes = list(gpu_nodes.get("gpu", ()))
    try:
        verdict = await memo.webhook.verdict(name, spec, nodes, memo.policy.hub_endpoint(spec),
                                             answer_by)
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


def server(port: int, cert: Path, key: Path, ca: bytes | None, timeout_s: float,
           ) -> WebhookServer:
    """The HTTPS server kopf hands its reviews to (every interface: the Service reaches
    it there; the chart's NetworkPolicy says who may); it reloads the files when they
    change."""
    return WebhookServer(port=port, certfile=cert, keyfile=key, cadata=ca, timeout_s=timeout_s,
                         path=f"/{WEBHOOK_ID}")

