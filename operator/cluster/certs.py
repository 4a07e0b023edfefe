"""The admission webhook's serving certificate when cert-manager does not make it.

The chart's ``webhook.certificates: self-signed``: the operator makes a CA and a serving
certificate for its Service's DNS names, keeps them in a Secret of its own namespace
(``kubernetes.io/tls``: ``tls.crt``, ``tls.key``, ``ca.crt``), and writes the CA into the
``caBundle`` of each webhook of the chart's ValidatingWebhookConfiguration, so the API
server trusts it. A Secret already there is reused while its certificate names the Service
and has more than ``RENEW_BEFORE`` left; otherwise a new pair replaces it. The operator
checks again every ``CHECK_INTERVAL_S`` (``renew_forever``) and kopf's webhook server,
which reads the files every minute, restarts itself on the new ones.

With cert-manager the chart mounts the Certificate's Secret instead, and cert-manager's CA
injector fills the caBundle: nothing here runs.
"""

from __future__ import annotations

import asyncio
import base64
import datetime
import logging
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from kvledger.operator.cluster.kube import KubeApi, KubeError, object_path

VALID_FOR = datetime.timedelta(days=365)
RENEW_BEFORE = datetime.timedelta(days=30)
CHECK_INTERVAL_S = 24 * 3600.0
WEBHOOK_CONFIGURATIONS = "/apis/admissionregistration.k8s.io/v1/validatingwebhookconfigurations"
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TlsFiles:
    """PEM bytes of the serving pair and the CA the API server is to trust."""

    cert: bytes
    key: bytes
    ca: bytes

    def write(self, folder: Path) -> tuple[Path, Path]:
        """``tls.crt`` and ``tls.key`` in ``folder`` (the key readable by this user alone)."""
        folder.mkdir(parents=True, exist_ok=True)
        cert, key = folder / "tls.crt", folder / "tls.key"
        key.touch(mode=0o600)
        key.write_bytes(self.key)
        cert.write_bytes(self.cert)
        return cert, key


def dns_names(service: str, namespace: str) -> list[str]:
    """The names the API server may call a Service by."""
    return [f"{service}.{namespace}.svc", f"{service}.{namespace}.svc.cluster.local"]


def make_pair(names: list[str], now: datetime.datetime | None = None) -> TlsFiles:
    """A new CA (ECDSA P-256) and a serving certificate for ``names`` that it signs."""
    now = now or datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kvledger webhook CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - datetime.timedelta(minutes=5))
          .not_valid_after(now + VALID_FOR)
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False,
                                       data_encipherment=False, key_agreement=False,
                                       encipher_only=False, decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0])]))
            .issuer_name(ca_name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + VALID_FOR)
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(n) for n in names]),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    pem = serialization.Encoding.PEM
    return TlsFiles(
        cert=cert.public_bytes(pem),
        key=key.private_bytes(pem, serialization.PrivateFormat.PKCS8,
                              serialization.NoEncryption()),
        ca=ca.public_bytes(pem))


def still_good(files: TlsFiles, names: list[str], now: datetime.datetime | None = None) -> bool:
    """Whether a kept pair names every one of ``names`` and has more than RENEW_BEFORE left."""
    now = now or datetime.datetime.now(datetime.UTC)
    try:
        cert = x509.load_pem_x509_certificate(files.cert)
        x509.load_pem_x509_certificate(files.ca)
        serialization.load_pem_private_key(files.key, password=None)
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName)
    except (ValueError, TypeError, x509.ExtensionNotFound):
        return False
    named = set(sans.value.get_values_for_type(x509.DNSName))
    return set(names) <= named and cert.not_valid_after_utc - now > RENEW_BEFORE


async def ensure(kube: KubeApi, *, namespace: str, secret: str, service: str,
                 configuration: str) -> TlsFiles:
    """The pair kept in ``secret`` (made, or renewed, when needed), with its CA written into
    every webhook of ``configuration``. Raises KubeError when the API server refuses."""
    names = dns_names(service, namespace)
    path = object_path("v1", "secrets", namespace, secret)
    live = await kube.get(path)
    kept = _from_secret(live) if live is not None else None
    if kept is not None and still_good(kept, names):
        files = kept
    else:
        files = make_pair(names)
        body = {"apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/tls",
                "metadata": {"name": secret, "namespace": namespace,
                             "labels": {"app.kubernetes.io/managed-by": "kvledger"}},
                "data": {key: base64.b64encode(value).decode("ascii") for key, value in
                         (("tls.crt", files.cert), ("tls.key", files.key), ("ca.crt", files.ca))}}
        if live is None:
            await kube.create(object_path("v1", "secrets", namespace), body)
        else:
            await kube.patch(path, {"data": body["data"]})
        logger.info(f"made the webhook's certificate for {', '.join(names)} (Secret {secret})")
    await inject_ca(kube, configuration, files.ca)
    return files


def _from_secret(secret: dict) -> TlsFiles | None:
    data = secret.get("data") or {}
    try:
        return TlsFiles(*(base64.b64decode(data[key]) for key in ("tls.crt", "tls.key", "ca.crt")))
    except (KeyError, ValueError, TypeError):
        return None


async def inject_ca(kube: KubeApi, configuration: str, ca: bytes) -> None:
    """Write ``ca`` into each webhook's caBundle (the list is sent whole, as merge patches
    replace lists; the resourceVersion makes a concurrent edit fail instead of lost)."""
    path = f"{WEBHOOK_CONFIGURATIONS}/{configuration}"
    live = await kube.get(path)
    if live is None:
        raise KubeError(404, f"the ValidatingWebhookConfiguration {configuration} is not there "
                             "(the chart renders it with webhook.enabled)")
    bundle = base64.b64encode(ca).decode("ascii")
    webhooks = live.get("webhooks") or []
    if all(w.get("clientConfig", {}).get("caBundle") == bundle for w in webhooks):
        return
    for webhook in webhooks:
        webhook.setdefault("clientConfig", {})["caBundle"] = bundle
    version = (live.get("metadata") or {}).get("resourceVersion")
    await kube.patch(path, {"webhooks": webhooks,
                            **({"metadata": {"resourceVersion": version}} if version else {})})


async def renew_forever(kube: KubeApi, folder: Path, **where: str) -> None:
    """Check the pair every CHECK_INTERVAL_S and write a renewed one into ``folder``; the
    client is closed when the task is cancelled."""
    try:
        while True:
            await asyncio.sleep(CHECK_INTERVAL_S)
            try:
                (await ensure(kube, **where)).write(folder)
            except (KubeError, OSError) as exc:
                logger.warning(f"cannot check the webhook's certificate, again in a day: {exc}")
    finally:
        await kube.close()
