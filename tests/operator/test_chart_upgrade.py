"""The chart against a live cluster (kmock's emulator): ``helm template --dry-run=server``
runs the templates' ``lookup`` and reads the served API groups, as ``helm upgrade`` does.
In self-signed mode an upgrade keeps the caBundle the operator wrote into the
ValidatingWebhookConfiguration; where the cluster serves cert-manager.io/v1, auto picks
cert-manager and the chart leaves the caBundle to its CA injector."""

from __future__ import annotations

import asyncio
import subprocess

import kmock
import pytest
from chart_harness import CHART, HELM, by_kind
from operator_harness import Cluster, emulated_cluster

pytestmark = pytest.mark.skipif(HELM is None, reason="helm is not installed "
                                "(bash scripts/helm_check.sh installs it into .tools/)")

CA_BUNDLE = "Q0E="  # what the operator wrote: base64 of "CA"
HOOK = "inferenceservices.kvledger.dev"
VWC = "/apis/admissionregistration.k8s.io/v1/validatingwebhookconfigurations"


async def serve_core_discovery(cluster: Cluster) -> None:
    """kmock 0.8 serves /api/v1 with groupVersion "/v1", which helm cannot map; serve the
    core kinds the chart renders as the API server does."""
    resources = [{"name": plural, "singularName": "", "namespaced": True, "kind": kind,
                  "verbs": ["get", "list", "create", "patch"]}
                 for plural, kind in (("serviceaccounts", "ServiceAccount"),
                                      ("services", "Service"))]
    cluster.emulator["get /api/v1"] << {"kind": "APIResourceList", "apiVersion": "v1",
                                        "groupVersion": "v1", "resources": resources}


async def installed_configuration(cluster: Cluster) -> None:
    """The configuration of an earlier install, its caBundle patched in by the operator
    (and helm's ownership marks, without which helm refuses to adopt it)."""
    await cluster.api.create(VWC, {
        "apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingWebhookConfiguration",
        "metadata": {"name": "kvledger", "labels": {"app.kubernetes.io/managed-by": "Helm"},
                     "annotations": {"meta.helm.sh/release-name": "kvledger",
                                     "meta.helm.sh/release-namespace": "kvledger-system"}},
        "webhooks": [{"name": HOOK, "clientConfig": {"caBundle": CA_BUNDLE},
                      "sideEffects": "None", "admissionReviewVersions": ["v1"]}]})


async def render_against(cluster: Cluster, *flags: str) -> dict[str, list[dict]]:
    done = await asyncio.to_thread(subprocess.run, [
        HELM, "template", "kvledger", str(CHART), "--namespace", "kvledger-system",
        "--dry-run=server", "--disable-openapi-validation", "--kubeconfig", cluster.kubeconfig,
        *flags], capture_output=True, text=True, timeout=60)
    return by_kind(done)


async def test_an_upgrade_keeps_the_ca_bundle_the_operator_wrote():
    async with emulated_cluster() as cluster:
        await serve_core_discovery(cluster)
        fresh = await render_against(cluster)
        [hook] = fresh["ValidatingWebhookConfiguration"][0]["webhooks"]
        assert "caBundle" not in hook["clientConfig"]  # a first install: none yet

        await installed_configuration(cluster)
        rendered = await render_against(cluster)
        assert "Certificate" not in rendered
        [hook] = rendered["ValidatingWebhookConfiguration"][0]["webhooks"]
        assert hook["name"] == HOOK
        assert hook["clientConfig"] == {
            "service": {"namespace": "kvledger-system", "name": "kvledger-webhook",
                        "path": "/validate", "port": 443},
            "caBundle": CA_BUNDLE}


async def test_a_cluster_serving_cert_manager_gets_its_certificate_and_no_ca_bundle():
    async with emulated_cluster() as cluster:
        await serve_core_discovery(cluster)
        for plural, kind in (("certificates", "Certificate"), ("issuers", "Issuer")):
            cluster.emulator.resources[f"cert-manager.io/v1/{plural}"] = kmock.ResourceInfo(
                namespaced=True, kind=kind, singular=kind.lower(), verbs={"get", "create"})
        await installed_configuration(cluster)
        rendered = await render_against(cluster)
        assert {"Certificate", "Issuer"} <= set(rendered)
        [config] = rendered["ValidatingWebhookConfiguration"]
        assert config["metadata"]["annotations"] == {
            "cert-manager.io/inject-ca-from": "kvledger-system/kvledger-webhook"}
        assert "caBundle" not in config["webhooks"][0]["clientConfig"]
