"""The admission webhook as the API server meets it: ``kvledger operator --webhook-port``
(its own process, as the chart runs it) against kmock's Kubernetes emulator, asked over
HTTPS with AdmissionReview v1 bodies as kube-apiserver sends them (tests/webhook_harness.py).

Self-signed mode: the operator makes its CA and certificate, keeps them in a Secret of its
namespace and writes the CA into the ValidatingWebhookConfiguration's caBundle; the client
trusts that caBundle alone and checks the certificate against the Service's DNS name, as
the API server does. The GPU nodes come from a watch (a node added later changes the
verdict); a hub model is planned from tests/hub_server.py. cert-manager mode reads the
mounted Secret's files; a missing flag stops the operator with one line."""

from __future__ import annotations

import base64
import os
import subprocess
import sys

import pytest
from _server_helpers import free_port
from hub_server import HubServer
from operator_harness import emulated_cluster, eventually
from webhook_harness import (
    WEBHOOK_NAMESPACE,
    WEBHOOK_SECRET,
    WebhookClient,
    admission_review,
    webhook_operator,
)

from kvledger.operator.cluster import certs

H100 = {"nvidia.com/gpu.memory": "81559", "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
        "nvidia.com/gpu.count": "1"}


def node(name: str, gpus: str, labels: dict) -> dict:
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": labels},
            "spec": {}, "status": {"allocatable": {"nvidia.com/gpu": gpus}}}


@pytest.fixture(scope="module")
def hub(make_model_dir):
    with HubServer() as server:
        server.add_commit("org/small-llama", make_model_dir("small-llama"))
        yield server


async def test_the_webhook_over_https_refuses_allows_and_warns(hub, tmp_path):
    async with emulated_cluster() as cluster:
        await cluster.api.create("/api/v1/nodes", node("big", "1", H100))
        async with webhook_operator(cluster, tmp_path / "log",
                                    policy={"hubEndpoints": [hub.url]}) as client:
            secret = cluster.stored("v1", "secrets", WEBHOOK_NAMESPACE, WEBHOOK_SECRET)
            assert secret["type"] == "kubernetes.io/tls"
            assert base64.b64decode(secret["data"]["ca.crt"]) == client.ca_pem
            await _verdicts(cluster, client)


async def _verdicts(cluster, client):
    ask = client.ask
    hub_spec = {"model": {"uri": "hf://org/small-llama"}, "gpus": 1,
                "engine": {"maxModelLen": 2048, "maxNumSeqs": 64}}
    fits = await ask(admission_review(hub_spec))
    assert fits["allowed"] and not fits.get("warnings"), fits
    too_big = dict(hub_spec, engine={"maxModelLen": 2048, "maxNumSeqs": 60000})
    for body in (admission_review(too_big), admission_review(too_big, dry_run=True),
                 admission_review(too_big, operation="UPDATE", old_spec=hub_spec)):
        refused = await ask(body)
        assert not refused["allowed"], refused
        assert refused["status"]["code"] == 403
        message = refused["status"]["message"]
        assert message.startswith("llm does not fit any node it may run on: the largest "
                                  "offers 1 x 79.6 GiB")
        assert "big" not in message  # what a node offers, never its name
        assert "to fit, in the InferenceService: engine.maxModelLen: " in message
    # An update that leaves the spec alone (kopf's annotations, finalizers) passes.
    same = await ask(admission_review(too_big, operation="UPDATE", old_spec=too_big))
    assert same["allowed"]
    invalid = await ask(admission_review({"model": {"path": "/m"}, "gpus": 1,
                                          "engine": {"maxModelLen": 0}}))
    assert not invalid["allowed"] and invalid["status"]["code"] == 422
    local = await ask(admission_review({"model": {"path": "/models/x"}, "gpus": 1}))
    assert local["allowed"] and "on the pod's volume" in local["warnings"][0]
    # A host another namespace's clients use, claimed at KEDA's one interceptor: refused
    # at kubectl apply, naming the Helm value; the service's own cluster name is not.
    scaling = {"provider": "keda", "minReplicas": 0, "maxReplicas": 2}
    stolen = await ask(admission_review({"model": {"path": "/m"}, "autoscaling": {
        **scaling, "httpAddOn": {"hosts": ["chat.team-b.svc.cluster.local"]}}},
        name="chat", namespace="team-a"))
    assert not stolen["allowed"] and stolen["status"]["code"] == 403
    assert "policy.httpAddOnHosts" in stolen["status"]["message"]
    own = await ask(admission_review({"model": {"path": "/m"}, "autoscaling": {
        **scaling, "httpAddOn": {"hosts": ["chat.team-a.svc.cluster.local"]}}},
        name="chat", namespace="team-a"))
    assert own["allowed"], own
    # A node whose GPUs GFD did not label: the watch brings it in, and the same request
    # is now allowed with a warning.
    await cluster.api.create("/api/v1/nodes", node("dark", "8", {}))

    async def warned():
        answer = await ask(admission_review(too_big))
        return answer if answer["allowed"] else None

    answer = await eventually(warned, timeout_s=20, what="the new node in the index")
    assert "1 with no GPU feature discovery labels" in answer["warnings"][0]
    assert "dark" not in answer["warnings"][0]


async def test_cert_manager_mode_serves_the_mounted_certificate(tmp_path):
    """The chart's cert-manager mode: tls.crt and tls.key from the Certificate's Secret."""
    files = certs.make_pair(certs.dns_names("kvledger-webhook", WEBHOOK_NAMESPACE))
    mounted = tmp_path / "webhook"
    files.write(mounted)
    (mounted / "ca.crt").write_bytes(files.ca)
    port = free_port()
    async with emulated_cluster() as cluster:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvledger.engine.cli", "operator", "--namespace", "default",
             "--webhook-port", str(port), "--webhook-tls", "cert-manager",
             "--webhook-cert-dir", str(mounted)],
            env={**os.environ, "KUBECONFIG": cluster.kubeconfig},
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        client = WebhookClient(port, files.ca)
        try:
            async def answers():
                assert proc.poll() is None, proc.stderr.read()
                try:
                    return await client.ask(admission_review({"model": {"path": "/m"}}))
                except OSError:
                    return None

            assert (await eventually(answers, timeout_s=60, what="an answer"))["allowed"]
            assert cluster.stored("v1", "secrets", WEBHOOK_NAMESPACE, WEBHOOK_SECRET) is None
        finally:
            await client.close()
            proc.terminate()
            proc.wait(timeout=30)


@pytest.mark.parametrize(("flags", "said"), [
    (["--webhook-port", "70000"], "a port is 1-65535"),
    (["--webhook-port", "8443", "--webhook-tls", "cert-manager"], "needs --webhook-cert-dir"),
    (["--webhook-port", "8443"], "needs --webhook-service, --webhook-secret, "
                                 "--webhook-configuration"),
    (["--webhook-port", "8443", "--webhook-timeout", "45", "--webhook-service", "s"],
     "waits 1 to 30 seconds"),
])
def test_a_webhook_flag_missing_or_wrong_stops_the_operator_with_one_line(flags, said):
    done = subprocess.run([sys.executable, "-m", "kvledger.engine.cli", "operator", *flags],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("error: ") and said in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1

