"""The webhook's self-signed certificate (operator/cluster/certs.py) against kmock's emulator: made
once and kept in its Secret, reused while it is good, replaced when it nears its end or no
longer names the Service, and its CA written into every webhook of the configuration."""

from __future__ import annotations

import base64
import datetime
import ssl

import pytest
from operator_harness import emulated_cluster
from webhook_harness import WEBHOOK_CONFIGURATIONS

from kvledger.operator.cluster import certs
from kvledger.operator.cluster.kube import KubeError

WHERE = {"namespace": "ops", "secret": "hook-tls", "service": "hook",
         "configuration": "kvledger"}
NAMES = certs.dns_names("hook", "ops")


async def configuration(cluster, webhooks: int = 2) -> None:
    await cluster.api.create(WEBHOOK_CONFIGURATIONS, {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingWebhookConfiguration", "metadata": {"name": "kvledger"},
        "webhooks": [{"name": f"w{i}.kvledger.dev", "sideEffects": "None",
                      "admissionReviewVersions": ["v1"],
                      "clientConfig": {"service": {"namespace": "ops", "name": "hook"}}}
                     for i in range(webhooks)]})


def bundles(cluster) -> list[bytes]:
    live = cluster.stored_cluster(WEBHOOK_CONFIGURATIONS, "kvledger")
    return [base64.b64decode(w["clientConfig"]["caBundle"]) for w in live["webhooks"]]


async def test_made_once_kept_in_its_secret_and_reused():
    async with emulated_cluster() as cluster:
        await configuration(cluster)
        first = await certs.ensure(cluster.api, **WHERE)
        assert bundles(cluster) == [first.ca, first.ca]
        again = await certs.ensure(cluster.api, **WHERE)
        assert again == first
        # the pair is a working TLS server pair, trusted through the CA alone
        context = ssl.create_default_context(cadata=first.ca.decode())
        assert context.cert_store_stats()["x509_ca"] == 1
        assert certs.still_good(first, NAMES)


async def test_an_expiring_or_misnamed_pair_is_replaced_and_the_ca_rewritten():
    async with emulated_cluster() as cluster:
        await configuration(cluster)
        old = certs.make_pair(NAMES, now=datetime.datetime.now(datetime.UTC)
                              - certs.VALID_FOR + datetime.timedelta(days=10))
        assert not certs.still_good(old, NAMES)
        await cluster.api.create("/api/v1/namespaces/ops/secrets", {
            "apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/tls",
            "metadata": {"name": "hook-tls", "namespace": "ops"},
            "data": {"tls.crt": base64.b64encode(old.cert).decode(),
                     "tls.key": base64.b64encode(old.key).decode(),
                     "ca.crt": base64.b64encode(old.ca).decode()}})
        new = await certs.ensure(cluster.api, **WHERE)
        assert new.ca != old.ca and bundles(cluster) == [new.ca, new.ca]
        stored = cluster.stored("v1", "secrets", "ops", "hook-tls")
        assert base64.b64decode(stored["data"]["tls.crt"]) == new.cert
        assert not certs.still_good(new, certs.dns_names("other", "ops"))


async def test_without_the_chart_configuration_it_says_so():
    async with emulated_cluster() as cluster:
        with pytest.raises(KubeError, match="ValidatingWebhookConfiguration kvledger is not"):
            await certs.ensure(cluster.api, **WHERE)


def test_the_key_file_is_written_for_this_user_alone(tmp_path):
    cert, key = certs.make_pair(NAMES).write(tmp_path / "tls")
    assert key.stat().st_mode & 0o777 == 0o600
    assert cert.read_bytes().startswith(b"-----BEGIN CERTIFICATE-----")
