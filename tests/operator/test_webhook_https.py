"""The admission webhook as the API server meets it: ``kvledger operator --webhook-port``
(its own process, as the chart runs it) against kmock's Kubernetes emulator, asked over
HTTPS with AdmissionReview v1 bodies as kube-apiserver sends them.

Self-signed mode: the operator makes its CA and certificate, keeps them in a Secret of its
namespace and writes the CA into the ValidatingWebhookConfiguration's caBundle; the test
trusts that caBundle alone and checks the certificate against the Service's DNS name, as
the API server does. The GPU nodes come from a watch (a node added later changes the
verdict); a hub model is planned from tests/hub_server.py."""

from __future__ import annotations

import base64
import json
import os
import ssl
import subprocess
import sys
import uuid

import aiohttp
import pytest
from _server_helpers import free_port
from hub_server import HubServer
from operator_harness import emulated_cluster, eventually

from kvledger.operator.resource import API_VERSION, GROUP, KIND, PLURAL, VERSION

NAMESPACE = "kvledger-system"
SERVICE, SECRET, CONFIGURATION = "kvledger-webhook", "kvledger-webhook-tls", "kvledger"
VWC_PATH = "/apis/admissionregistration.k8s.io/v1/validatingwebhookconfigurations"
H100 = {"nvidia.com/gpu.memory": "81559", "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
        "nvidia.com/gpu.count": "1"}


def node(name: str, gpus: str, labels: dict) -> dict:
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": labels},
            "spec": {}, "status": {"allocatable": {"nvidia.com/gpu": gpus}}}


def review(spec: dict, *, operation: str = "CREATE", old_spec: dict | None = None,
           dry_run: bool = False, name: str = "llm") -> dict:
    """An AdmissionReview v1 request as kube-apiserver sends it to a validating webhook."""
    obj = {"apiVersion": API_VERSION, "kind": KIND,
           "metadata": {"name": name, "namespace": "default"}, "spec": spec}
    request = {
        "uid": str(uuid.uuid4()),
        "kind": {"group": GROUP, "version": VERSION, "kind": KIND},
        "resource": {"group": GROUP, "version": VERSION, "resource": PLURAL},
        "requestKind": {"group": GROUP, "version": VERSION, "kind": KIND},
        "requestResource": {"group": GROUP, "version": VERSION, "resource": PLURAL},
        "name": name, "namespace": "default", "operation": operation,
        "userInfo": {"username": "alice", "groups": ["system:authenticated"]},
        "object": obj,
        "oldObject": (dict(obj, spec=old_spec) if old_spec is not None else None),
        "dryRun": dry_run,
        "options": {"apiVersion": "meta.k8s.io/v1",
                    "kind": "CreateOptions" if operation == "CREATE" else "UpdateOptions"},
    }
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": request}


@pytest.fixture(scope="module")
def hub(make_model_dir):
    with HubServer() as server:
        server.add_commit("org/small-llama", make_model_dir("small-llama"))
        yield server


async def test_the_webhook_over_https_refuses_allows_and_warns(hub, tmp_path):
    port = free_port()
    async with emulated_cluster() as cluster:
        await cluster.api.create(VWC_PATH, {
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "ValidatingWebhookConfiguration", "metadata": {"name": CONFIGURATION},
            "webhooks": [{"name": "inferenceservices.kvledger.dev", "clientConfig": {
                "service": {"namespace": NAMESPACE, "name": SERVICE, "path": "/validate"}},
                "sideEffects": "None", "admissionReviewVersions": ["v1"]}]})
        await cluster.api.create("/api/v1/nodes", node("big", "1", H100))
        env = {**os.environ, "KUBECONFIG": cluster.kubeconfig, "POD_NAMESPACE": NAMESPACE,
               "KVLEDGER_POLICY": json.dumps({"hubEndpoints": [hub.url]})}
        log = (tmp_path / "log").open("w")
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvledger.engine.cli", "operator", "--namespace", "default",
             "--webhook-port", str(port), "--webhook-tls", "self-signed",
             "--webhook-service", SERVICE, "--webhook-secret", SECRET,
             "--webhook-configuration", CONFIGURATION, "--webhook-timeout", "8"],
            env=env, stdout=subprocess.DEVNULL, stderr=log)
        try:
            await _check(cluster, port, proc, tmp_path)
        finally:
            proc.terminate()
            proc.wait(timeout=30)
            log.close()


async def _check(cluster, port, proc, tmp_path):
    def patched():
        assert proc.poll() is None, (tmp_path / "log").read_text()
        live = cluster.emulator.objects
        for (resource, _, name), obj in live.items():
            if resource.plural == "validatingwebhookconfigurations" and name == CONFIGURATION:
                return obj.raw["webhooks"][0]["clientConfig"].get("caBundle")
        return None

    bundle = await eventually(patched, timeout_s=60, what="the caBundle written")
    secret = cluster.stored("v1", "secrets", NAMESPACE, SECRET)
    assert secret["type"] == "kubernetes.io/tls"
    assert base64.b64decode(secret["data"]["ca.crt"]) == base64.b64decode(bundle)
    trust = ssl.create_default_context(cadata=base64.b64decode(bundle).decode())
    async with aiohttp.ClientSession() as http:

        async def ask(body: dict) -> dict:
            async with http.post(f"https://127.0.0.1:{port}/validate", json=body, ssl=trust,
                                 server_hostname=f"{SERVICE}.{NAMESPACE}.svc") as response:
                assert response.status == 200, await response.text()
                answer = await response.json()
            assert answer["apiVersion"] == "admission.k8s.io/v1"
            assert answer["kind"] == "AdmissionReview"
            assert answer["response"]["uid"] == body["request"]["uid"]
            return answer["response"]

        async def up():
            assert proc.poll() is None, (tmp_path / "log").read_text()
            try:
                return await ask(review({"model": {"path": "/m"}, "gpus": 0}))
            except aiohttp.ClientConnectorError:
                return None

        assert (await eventually(up, timeout_s=60, what="the webhook answering"))["allowed"]
        hub_spec = {"model": {"uri": "hf://org/small-llama"}, "gpus": 1,
                    "engine": {"maxModelLen": 2048, "maxNumSeqs": 64}}
        fits = await ask(review(hub_spec))
        assert fits["allowed"] and not fits.get("warnings"), fits
        too_big = dict(hub_spec, engine={"maxModelLen": 2048, "maxNumSeqs": 60000})
        for body in (review(too_big), review(too_big, dry_run=True),
                     review(too_big, operation="UPDATE", old_spec=hub_spec)):
            refused = await ask(body)
            assert not refused["allowed"], refused
            assert refused["status"]["code"] == 403
            message = refused["status"]["message"]
            assert message.startswith("llm does not fit any node it may run on: the largest, "
                                      "big, offers 1 x 79.6 GiB")
            assert "to fit, in the InferenceService: engine.maxModelLen: " in message
        # An update that leaves the spec alone (kopf's annotations, finalizers) passes.
        same = await ask(review(too_big, operation="UPDATE", old_spec=too_big))
        assert same["allowed"]
        invalid = await ask(review({"model": {"path": "/m"}, "gpus": 1,
                                    "engine": {"maxModelLen": 0}}))
        assert not invalid["allowed"] and invalid["status"]["code"] == 422
        local = await ask(review({"model": {"path": "/models/x"}, "gpus": 1}))
        assert local["allowed"] and "on the pod's volume" in local["warnings"][0]
        # A node whose GPUs GFD did not label: the watch brings it in, and the same
        # request is now allowed with a warning.
        await cluster.api.create("/api/v1/nodes", node("dark", "8", {}))

        async def warned():
            answer = await ask(review(too_big))
            return answer if answer["allowed"] else None

        answer = await eventually(warned, timeout_s=20, what="the new node in the index")
        assert "dark: no GPU feature discovery labels" in answer["warnings"][0]
