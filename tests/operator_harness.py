"""Test harness: the real operator, in-process, against kmock's Kubernetes emulator over HTTP.

Used by tests/operator/ and tests/test_docs.py (kmock is a test dependency, so this lives with the tests).
kmock does not assign ``uid``, ``resourceVersion`` or ``generation``, so ``Cluster``
sets them the way an API server would when a test creates or edits a resource.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import kmock
import kopf
import yaml

from kvledger.operator.api.resource import (
    API_VERSION,
    GROUP,
    KIND,
    PLURAL,
    SHORT_NAMES,
    SINGULAR,
    VERSION,
)
from kvledger.operator.cluster.kube import KubeApi, object_path
from kvledger.operator.main import operator_memo
from kvledger.operator.render.render import LABEL


class Emulator(kmock.KubernetesEmulator):
    """kmock's emulator, plus ``metadata.generateName`` (kopf names its events that way),
    and reviews (a SubjectAccessReview) answered by the test's reaction and never stored, as
    the API server answers them: kmock stores every create, and a second review (nameless
    as the first) was a 409."""

    _generated = itertools.count(1)
    REVIEWS = frozenset({"subjectaccessreviews", "selfsubjectaccessreviews",
                         "localsubjectaccessreviews", "tokenreviews"})

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.asked: list[tuple[str, str]] = []  # (method, resource plural) of every request

    async def _handle(self, request: kmock.Request) -> Any:
        self.asked.append((request.method.value, str(getattr(request.resource, "plural", ""))))
        if getattr(request.resource, "plural", None) in self.REVIEWS:
            return await kmock.KubernetesScaffold._handle(self, request)  # the reactions alone
        meta = request.data.get("metadata") if isinstance(request.data, dict) else None
        if (request.method == kmock.method.POST and isinstance(meta, dict)
                and "name" not in meta and meta.get("generateName")):
            meta["name"] = f"{meta['generateName']}{next(self._generated):05d}"
        return await super()._handle(request)


class Cluster:
    """What a test sees: the emulator's stored objects and a client that edits them."""

    def __init__(self, emulator: kmock.KubernetesEmulator, api: KubeApi) -> None:
        self.emulator = emulator
        self.api = api
        self.kubeconfig = ""  # a kubeconfig file pointing at the emulator
        self.url = ""  # the emulator's base URL
        self._versions = itertools.count(1000)

    def stored(self, api_version: str, plural: str, namespace: str, name: str) -> dict | None:
        """The emulator's current copy of an object, or None when absent or deleted."""
        for (resource, ns, obj_name), obj in self.emulator.objects.items():
            if (f"{resource.group}/{resource.version}".lstrip("/") == api_version
                    and resource.plural == plural and ns == namespace and obj_name == name):
                return None if obj.deleted else dict(obj.raw)
        return None

    def history(self, api_version: str, plural: str, namespace: str, name: str) -> list[dict]:
        """Every version the emulator kept of an object, oldest first (deletions skipped)."""
        for (resource, ns, obj_name), obj in self.emulator.objects.items():
            if (f"{resource.group}/{resource.version}".lstrip("/") == api_version
                    and resource.plural == plural and ns == namespace and obj_name == name):
                return [dict(version.raw) for version in obj.history if version is not None]
        return []

    def stored_cluster(self, collection: str, name: str) -> dict | None:
        """A cluster-scoped object by its collection's path (``/api/v1/nodes``)."""
        for (resource, _, obj_name), obj in self.emulator.objects.items():
            if collection.endswith("/" + resource.plural) and obj_name == name:
                return None if obj.deleted else dict(obj.raw)
        return None

    def all_stored(self, plural: str) -> list[dict]:
        return [dict(obj.raw) for (resource, _, _), obj in self.emulator.objects.items()
                if resource.plural == plural and not obj.deleted]

    async def create(self, api_version: str, plural: str, body: dict[str, Any]) -> dict:
        meta = body.setdefault("metadata", {})
        meta.setdefault("uid", f"uid-{meta['name']}-{next(self._versions)}")
        meta.setdefault("generation", 1)
        meta.setdefault("creationTimestamp", "2026-01-01T00:00:00Z")
        meta["resourceVersion"] = str(next(self._versions))
        # Raw, not through the operator's typed ``create``: a test's object stands for what
        # others wrote (a kubelet's pod with only the status fields a test reads).
        return await self.api.request("POST", object_path(api_version, plural,
                                                          meta["namespace"]), body) or {}

    async def patch(self, api_version: str, plural: str, namespace: str, name: str,
                    body: dict[str, Any], *, bump_generation: bool = False,
                    subresource: str = "") -> dict:
        meta = body.setdefault("metadata", {})
        meta["resourceVersion"] = str(next(self._versions))
        if bump_generation:
            live = self.stored(api_version, plural, namespace, name) or {}
            meta["generation"] = live.get("metadata", {}).get("generation", 1) + 1
        path = object_path(api_version, plural, namespace, name)
        return await self.api.patch(path + (f"/{subresource}" if subresource else ""), body)

    async def delete(self, api_version: str, plural: str, namespace: str, name: str) -> bool:
        return await self.api.delete(object_path(api_version, plural, namespace, name))

    def events_for(self, name: str) -> list[dict]:
        return [e for e in self.all_stored("events")
                if e.get("involvedObject", {}).get("name") == name]


async def eventually(check: Callable[[], Any | Awaitable[Any]], *, timeout_s: float = 30.0,
                     what: str = "condition") -> Any:
    """Poll until ``check()`` returns something truthy; fail with ``what`` after the timeout
    (30 s: a reconcile on CI's two busy workers took over 10 s; a check that holds
    returns at once)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        result = check()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return result
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def emulated_cluster(lws: bool = True, pool: bool = False,
                           http_add_on: bool = False,
                           objectives: bool = False) -> AsyncIterator[Cluster]:
    """The emulator on a local port, the CRD, KEDA's ScaledObject, (``lws``)
    LeaderWorkerSet, (``pool``) GAIE's InferencePool and (``http_add_on``) KEDA's HTTP
    add-on's InterceptorRoute and (``objectives``) the router's InferenceObjective declared,
    and ``Cluster.kubeconfig`` for it.

    kmock merges a subresource's patch into the object, so a patch of ``scale`` with a
    Scale's body (``{"spec": {"replicas": N}}``) writes ``spec.replicas`` as the API
    server's scale subresource does."""
    emulator = Emulator()
    emulator.resources.load_bundled()
    verbs = {"get", "list", "watch", "create", "update", "patch", "delete"}
    emulator.resources[f"{GROUP}/{VERSION}/{PLURAL}"] = kmock.ResourceInfo(
        namespaced=True, kind=KIND, singular=SINGULAR, shortnames=set(SHORT_NAMES),
        verbs=verbs, subresources={"status", "scale"})
    emulator.resources["keda.sh/v1alpha1/scaledobjects"] = kmock.ResourceInfo(
        namespaced=True, kind="ScaledObject", singular="scaledobject", shortnames={"so"},
        verbs=verbs, subresources={"status"})
    if lws:
        emulator.resources["leaderworkerset.x-k8s.io/v1/leaderworkersets"] = kmock.ResourceInfo(
            namespaced=True, kind="LeaderWorkerSet", singular="leaderworkerset",
            shortnames={"lws"}, verbs=verbs, subresources={"status", "scale"})
    if pool:
        emulator.resources["inference.networking.k8s.io/v1/inferencepools"] = kmock.ResourceInfo(
            namespaced=True, kind="InferencePool", singular="inferencepool", shortnames=set(),
            verbs=verbs, subresources={"status"})
    if objectives:
        emulator.resources["inference.networking.x-k8s.io/v1alpha2/inferenceobjectives"] = \
            kmock.ResourceInfo(namespaced=True, kind="InferenceObjective",
                               singular="inferenceobjective", shortnames=set(), verbs=verbs,
                               subresources={"status"})
    if http_add_on:
        emulator.resources["http.keda.sh/v1beta1/interceptorroutes"] = kmock.ResourceInfo(
            namespaced=True, kind="InterceptorRoute", singular="interceptorroute",
            shortnames={"ir"}, verbs=verbs, subresources={"status"})
    async with emulator, kmock.Server(emulator) as server:
        url = str(server.url).rstrip("/")
        with tempfile.TemporaryDirectory() as tmp:
            cluster = Cluster(emulator, KubeApi(kopf.ConnectionInfo(server=url)))
            cluster.url = url
            cluster.kubeconfig = os.path.join(tmp, "kubeconfig")
            with open(cluster.kubeconfig, "w") as f:
                yaml.safe_dump({
                    "apiVersion": "v1", "kind": "Config", "current-context": "kmock",
                    "clusters": [{"name": "kmock", "cluster": {"server": url}}],
                    "users": [{"name": "test", "user": {}}],
                    "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "test",
                                                               "namespace": "default"}}],
                }, f)
            try:
                yield cluster
            finally:
                await cluster.api.close()


@contextlib.asynccontextmanager
async def running_operator(default_image: str = "kvledger:test", policy=None,
                           lws: bool = True, pool: bool = False,
                           http_add_on: bool = False,
                           objectives: bool = False) -> AsyncIterator[Cluster]:
    """The emulator and the real operator in this event loop (login via KUBECONFIG), under
    ``policy`` (an ``operator.policy.Policy``; the Helm chart's defaults when None), on a
    cluster that serves LeaderWorkerSet or (``lws`` False) not, InferencePool (``pool``)
    or not, and InferenceObjective (``objectives``) or not."""
    from kvledger.operator.controller import handlers  # noqa: F401  (registers the handlers)

    async with emulated_cluster(lws, pool, http_add_on, objectives) as cluster:
        saved = os.environ.get("KUBECONFIG")
        os.environ["KUBECONFIG"] = cluster.kubeconfig
        stop, ready = asyncio.Event(), asyncio.Event()
        task = asyncio.create_task(kopf.operator(
            clusterwide=True, standalone=True, stop_flag=stop, ready_flag=ready,
            memo=operator_memo(default_image, policy=policy)))
        try:
            await asyncio.wait_for(ready.wait(), timeout=20)
            yield cluster
        finally:
            stop.set()
            with contextlib.suppress(asyncio.CancelledError, TimeoutError):
                await asyncio.wait_for(task, timeout=10)
            if saved is None:
                os.environ.pop("KUBECONFIG", None)
            else:
                os.environ["KUBECONFIG"] = saved


def service_manifest(name: str, namespace: str = "default", **spec: Any) -> dict[str, Any]:
    body_spec: dict[str, Any] = {"model": {"path": "/models/tiny-llama", "name": name}}
    body_spec.update(spec)
    return {"apiVersion": API_VERSION, "kind": KIND,
            "metadata": {"name": name, "namespace": namespace}, "spec": body_spec}


async def ready_for(cluster: Cluster, name: str, reason: str) -> dict:
    """The resource's Ready condition once its reason is ``reason`` (in namespace
    default)."""
    def ready() -> dict | None:
        found = condition(cluster.stored(API_VERSION, PLURAL, "default", name), "Ready")
        return found if found.get("reason") == reason else None

    return await eventually(ready, what=f"Ready=False/{reason}")


def condition(obj: dict | None, kind: str) -> dict:
    """The resource's status condition of type ``kind`` ({} when it has none)."""
    for c in ((obj or {}).get("status") or {}).get("conditions") or []:
        if c["type"] == kind:
            return c
    return {}


# Every placement and environment field, as Kubernetes writes it in a pod.
PLACEMENT = {
    "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-L4", "pool": "gpu"},
    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
                    {"key": "spot", "operator": "Equal", "value": "true",
                     "effect": "NoExecute", "tolerationSeconds": 600}],
    "affinity": {
        "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchExpressions": [
                {"key": "topology.kubernetes.io/zone", "operator": "In",
                 "values": ["us-east-1a", "us-east-1b"]}]}]}},
        "podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{
            "weight": 100, "podAffinityTerm": {
                "topologyKey": "kubernetes.io/hostname",
                "labelSelector": {"matchLabels": {"kvledger.dev/inferenceservice": "m"}}}}]}},
    "priorityClassName": "inference-high",
    "runtimeClassName": "nvidia",
    "imagePullSecrets": [{"name": "registry"}],
    "serviceAccountName": "llm-serving",
    "env": [{"name": "PYTORCH_CUDA_ALLOC_CONF", "value": "expandable_segments:True"},
            {"name": "NCCL_SOCKET_IFNAME", "valueFrom": {"configMapKeyRef": {
                "name": "network", "key": "interface"}}},
            {"name": "NCCL_DEBUG", "valueFrom": {"configMapKeyRef": {"name": "d", "key": "level"}}}],
    "podAnnotations": {"prometheus.io/scrape": "true"},
    "podLabels": {"team": "ml", "cost-center": "42"},
}


# The part of `kubectl describe inferenceservice` a user reads to learn why, laid out
# the way kubectl lays it out: conditions (messages below) and events.
def _table(headers: list[str], rows: list[list[str]], indent: str = "  ") -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    lines = [indent + "  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))]
    lines.append(indent + "  ".join(("-" * len(h)).ljust(w)
                                    for h, w in zip(headers, widths, strict=True)))
    for row in rows:
        lines.append(indent + "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)))
    return [line.rstrip() for line in lines]


def describe(obj: dict[str, Any], events: list[dict[str, Any]]) -> str:
    """Name, status fields, conditions (messages indented below) and events, oldest first."""
    meta, status = obj.get("metadata", {}), obj.get("status") or {}
    lines = [f"Name:         {meta.get('name')}",
             f"Namespace:    {meta.get('namespace')}",
             f"Kind:         {obj.get('kind')}",
             "Status:",
             f"  Endpoint:             {status.get('endpoint', '<none>')}",
             f"  Ready Replicas:       {status.get('readyReplicas', 0)}",
             f"  Observed Generation:  {status.get('observedGeneration', '<none>')}"]
    conditions = status.get("conditions") or []
    lines.append("Conditions:")
    if conditions:
        lines += _table(["Type", "Status", "Reason"],
                        [[c.get("type", ""), c.get("status", ""), c.get("reason", "")]
                         for c in conditions])
        for c in conditions:
            if c.get("message"):
                lines.append(f"  {c['type']} message:")
                lines += [f"    {line}" for line in c["message"].splitlines()]
    else:
        lines.append("  <none>")
    lines.append("Events:")
    if events:
        ordered = sorted(events, key=lambda e: e.get("lastTimestamp") or e.get("eventTime") or "")
        lines += _table(["Type", "Reason", "From", "Message"],
                        [[e.get("type", ""), e.get("reason", ""),
                          (e.get("source") or {}).get("component", "") or "kvledger",
                          e.get("message", "")] for e in ordered])
    else:
        lines.append("  <none>")
    return "\n".join(lines) + "\n"


def local_argv(container: dict[str, Any], mounts: dict[str, str]) -> list[str]:
    """A rendered container's command and args as a local ``kvledger`` process, each path
    under a mount (``mountPath -> local folder``) mapped the way the kubelet mounts it."""

    def local(arg: str) -> str:
        for pod_path, host_path in sorted(mounts.items(), key=lambda kv: -len(kv[0])):
            if arg == pod_path or arg.startswith(pod_path + "/"):
                return host_path + arg[len(pod_path):]
        return arg

    assert container["command"][0] == "kvledger"
    return [sys.executable, "-m", "kvledger.engine.cli", *container["command"][1:],
            *(local(a) for a in container["args"])]


NS = "default"
FALLBACK_LOG_LINES = 80  # the kubelet's FallbackToLogsOnError keeps the log's tail


def run_container(container: dict, pod_spec: dict, scratch: Path,
                  env: dict[str, str] | None = None) -> dict:
    """Run one container as a local process, as a kubelet would, with ``env`` (its env as
    the kubelet resolves it) over this process's; its terminated state."""
    volumes = {v["name"]: v for v in pod_spec["volumes"]}
    mounts = {}
    for mount in container["volumeMounts"]:
        volume = volumes[mount["name"]]
        if "hostPath" in volume:
            mounts[mount["mountPath"]] = volume["hostPath"]["path"]
        else:
            local = scratch / mount["name"]
            local.mkdir(parents=True, exist_ok=True)
            mounts[mount["mountPath"]] = str(local)
    termination_file = scratch / "termination-log"
    mounts[container.get("terminationMessagePath", "/dev/termination-log")] = str(
        termination_file)

    done = subprocess.run(local_argv(container, mounts), capture_output=True, text=True,
                          timeout=60, env={**os.environ, **(env or {})})
    message = termination_file.read_text() if termination_file.exists() else ""
    if not message and done.returncode != 0 \
            and container["terminationMessagePolicy"] == "FallbackToLogsOnError":
        message = "\n".join((done.stdout + done.stderr).splitlines()[-FALLBACK_LOG_LINES:])
    return {"exitCode": done.returncode, "reason": "Completed" if done.returncode == 0 else "Error",
            "message": message}


async def deploy_and_run_preflight(cluster, name: str, model_root: Path, scratch: Path,
                                   **spec) -> tuple[dict, dict]:
    """Create the resource, take the rendered pod, run its ``preflight`` as a kubelet would,
    and report the pod to the emulator; (pod spec, the container's terminated state)."""
    manifest = service_manifest(name, NS, gpus=0, **spec)
    manifest["spec"]["model"]["volume"] = {"hostPath": {"path": str(model_root)},
                                           "mountPath": "/models"}
    await cluster.create(API_VERSION, PLURAL, manifest)
    deployment = await eventually(
        lambda: cluster.stored("apps/v1", "deployments", NS, name), what="deployment")
    pod_spec = deployment["spec"]["template"]["spec"]
    [preflight] = pod_spec["initContainers"]
    terminated = run_container(preflight, pod_spec, scratch)
    await cluster.create("v1", "pods", {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": f"{name}-0", "namespace": NS, "labels": {LABEL: name}},
        "spec": pod_spec,
        "status": {"phase": "Pending", "initContainerStatuses": [{
            "name": "preflight", "ready": terminated["exitCode"] == 0, "restartCount": 0,
            "state": {"terminated": terminated}}]}})
    return pod_spec, terminated
