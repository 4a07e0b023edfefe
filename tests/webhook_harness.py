"""The operator's admission webhook as the API server meets it, for tests/operator/ and
bench/webhook_latency.py: ``kvledger operator --webhook-port`` in its own process (as the
chart runs it) against kmock's emulator, asked over HTTPS with AdmissionReview v1 bodies as
kube-apiserver sends them, trusting the caBundle the operator wrote and nothing else."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import ssl
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
from _server_helpers import free_port
from operator_harness import Cluster, eventually

from kvledger.operator.api.resource import API_VERSION, GROUP, KIND, PLURAL, VERSION

WEBHOOK_NAMESPACE = "kvledger-system"
WEBHOOK_SERVICE, WEBHOOK_SECRET, WEBHOOK_CONFIGURATION = (
    "kvledger-webhook", "kvledger-webhook-tls", "kvledger")
WEBHOOK_CONFIGURATIONS = "/apis/admissionregistration.k8s.io/v1/validatingwebhookconfigurations"
SERVER_NAME = f"{WEBHOOK_SERVICE}.{WEBHOOK_NAMESPACE}.svc"  # what the certificate names


def admission_review(spec: dict[str, Any], *, operation: str = "CREATE",
                     old_spec: dict[str, Any] | None = None, dry_run: bool = False,
                     name: str = "llm", namespace: str = "default",
                     user: dict[str, Any] | None = None) -> dict[str, Any]:
    """An AdmissionReview v1 request as kube-apiserver sends it to a validating webhook
    (``user``: its userInfo; alice's by default)."""
    obj = {"apiVersion": API_VERSION, "kind": KIND,
           "metadata": {"name": name, "namespace": namespace}, "spec": spec}
    kind = {"group": GROUP, "version": VERSION, "kind": KIND}
    resource = {"group": GROUP, "version": VERSION, "resource": PLURAL}
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
        "uid": str(uuid.uuid4()), "kind": kind, "resource": resource, "requestKind": kind,
        "requestResource": resource, "name": name, "namespace": namespace,
        "operation": operation,
        "userInfo": user or {"username": "alice", "groups": ["system:authenticated"]},
        "object": obj,
        "oldObject": dict(obj, spec=old_spec) if old_spec is not None else None,
        "dryRun": dry_run,
        "options": {"apiVersion": "meta.k8s.io/v1",
                    "kind": "CreateOptions" if operation == "CREATE" else "UpdateOptions"}}}


class WebhookClient:
    """Asks the operator's webhook as the API server does: over HTTPS to the Service's DNS
    name, trusting the configuration's caBundle alone, on one kept-alive connection."""

    def __init__(self, port: int, ca_pem: bytes) -> None:
        self.port, self.ca_pem = port, ca_pem
        self.trust = ssl.create_default_context(cadata=ca_pem.decode())
        self.pid: int | None = None  # the operator's process, when webhook_operator started it
        self._http = aiohttp.ClientSession()

    async def ask(self, body: dict[str, Any]) -> dict[str, Any]:
        """The AdmissionReview's response (its uid checked against the request's)."""
        async with self._http.post(
                f"https://127.0.0.1:{self.port}/validate", json=body, ssl=self.trust,
                server_hostname=SERVER_NAME) as response:
            assert response.status == 200, await response.text()
            answer = await response.json()
        assert (answer["apiVersion"], answer["kind"]) == ("admission.k8s.io/v1",
                                                          "AdmissionReview")
        assert answer["response"]["uid"] == body["request"]["uid"]
        return answer["response"]

    async def close(self) -> None:
        await self._http.close()


@contextlib.asynccontextmanager
async def webhook_operator(cluster: Cluster, log: Path, *, policy: dict[str, Any] | None = None,
                           timeout_s: float = 8.0) -> AsyncIterator[WebhookClient]:
    """``kvledger operator --webhook-port`` in self-signed mode, its own process against the
    emulator (with the chart's ValidatingWebhookConfiguration, no caBundle yet), once its
    CA is in the configuration and it answers; stderr goes to ``log``, its temporary files
    (TMPDIR) to the folder ``operator-tmp`` beside it."""
    port = free_port()
    await cluster.api.create(WEBHOOK_CONFIGURATIONS, {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingWebhookConfiguration", "metadata": {"name": WEBHOOK_CONFIGURATION},
        "webhooks": [{"name": "inferenceservices.kvledger.dev", "clientConfig": {"service": {
            "namespace": WEBHOOK_NAMESPACE, "name": WEBHOOK_SERVICE, "path": "/validate"}},
            "sideEffects": "None", "admissionReviewVersions": ["v1"]}]})
    tmp = log.parent / "operator-tmp"
    tmp.mkdir(exist_ok=True)
    env = {**os.environ, "KUBECONFIG": cluster.kubeconfig, "POD_NAMESPACE": WEBHOOK_NAMESPACE,
           "KVLEDGER_POLICY": json.dumps(policy or {}), "TMPDIR": str(tmp)}
    with log.open("w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvledger.engine.cli", "operator", "--namespace", "default",
             "--webhook-port", str(port), "--webhook-tls", "self-signed",
             "--webhook-service", WEBHOOK_SERVICE, "--webhook-secret", WEBHOOK_SECRET,
             "--webhook-configuration", WEBHOOK_CONFIGURATION,
             "--webhook-timeout", str(timeout_s)],
            env=env, stdout=subprocess.DEVNULL, stderr=stderr)
        client = None
        try:
            def bundle() -> bytes | None:
                assert proc.poll() is None, log.read_text()
                live = cluster.stored_cluster(WEBHOOK_CONFIGURATIONS, WEBHOOK_CONFIGURATION)
                ca = ((live or {}).get("webhooks") or [{}])[0].get("clientConfig", {})
                return base64.b64decode(ca["caBundle"]) if ca.get("caBundle") else None

            client = WebhookClient(port, await eventually(bundle, timeout_s=60,
                                                          what="the caBundle written"))
            client.pid = proc.pid

            async def answers() -> bool:
                assert proc.poll() is None, log.read_text()
                try:
                    await client.ask(admission_review({"model": {"path": "/m"}, "gpus": 0}))
                except aiohttp.ClientConnectorError:
                    return False
                return True

            await eventually(answers, timeout_s=60, what="the webhook answering")
            gpu_nodes = [n for n in cluster.all_stored("nodes") if int(
                ((n.get("status") or {}).get("allocatable") or {}).get("nvidia.com/gpu", 0))]

            async def sees_the_nodes() -> bool:
                """kopf's node index fills after the start: a review before it says no
                node offers GPUs. The nodes made before the operator are waited for."""
                answer = await client.ask(admission_review({"model": {"path": "/m"},
                                                            "gpus": 1}))
                return not any("offers nvidia.com/gpu now" in w
                               for w in answer.get("warnings") or [])

            if gpu_nodes:
                await eventually(sees_the_nodes, timeout_s=60, what="the node index filled")
            yield client
        finally:
            if client is not None:
                await client.close()
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:  # what Kubernetes does after the grace period
                proc.kill()
                proc.wait()


def gpu_node(name: str, gpus: int, mib: int | None, product: str | None = None) -> dict[str, Any]:
    """A Node as GPU feature discovery labels it (no labels with ``mib`` None), tainted as
    GPU node pools usually are."""
    labels = {"kubernetes.io/hostname": name}
    if mib is not None:
        labels |= {"nvidia.com/gpu.memory": str(mib), "nvidia.com/gpu.count": str(gpus),
                   **({"nvidia.com/gpu.product": product} if product else {})}
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": labels},
            "spec": {"taints": [{"key": "nvidia.com/gpu", "effect": "NoSchedule"}]},
            "status": {"allocatable": {"nvidia.com/gpu": str(gpus)}}}


def kubectl_says(response: dict[str, Any], name: str, file: str) -> str:
    """What ``kubectl apply -f FILE`` prints of a webhook's answer to a create: the denial
    as the API server hands it on, or each warning then the object created."""
    if not response["allowed"]:
        status = response["status"]
        reason = {403: "Forbidden", 422: "Invalid"}.get(status["code"], "InternalError")
        return (f'Error from server ({reason}): error when creating "{file}": admission '
                f'webhook "inferenceservices.kvledger.dev" denied the request: '
                f'{status["message"]}\n')
    warnings = "".join(f"Warning: {w}\n" for w in response.get("warnings") or [])
    return f"{warnings}inferenceservice.kvledger.dev/{name} created\n"
