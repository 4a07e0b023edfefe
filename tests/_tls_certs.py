"""Certificates for the TLS tests, made in the test: a CA and the server's or a client's
pair it signs (ECDSA P-256), written as PEM files."""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

_PEM = serialization.Encoding.PEM


@dataclass
class Authority:
    """A CA that signs leaf certificates."""

    name: str
    key: ec.EllipticCurvePrivateKey
    cert: x509.Certificate

    @classmethod
    def make(cls, name: str = "test CA") -> Authority:
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        cert = (_builder(subject, subject, key.public_key())
                .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                .sign(key, hashes.SHA256()))
        return cls(name, key, cert)

    def pem(self) -> bytes:
        return self.cert.public_bytes(_PEM)

    def write(self, path: Path) -> Path:
        path.write_bytes(self.pem())
        return path

    def leaf(self, folder: Path, name: str, *, client: bool = False,
             password: bytes | None = None) -> tuple[Path, Path]:
        """``folder/NAME.crt`` and ``folder/NAME.key``: a server certificate for localhost
        and 127.0.0.1 (``client``: one a client shows), its key encrypted with
        ``password`` if given."""
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        issuer = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, self.name)])
        usage = ExtendedKeyUsageOID.CLIENT_AUTH if client else ExtendedKeyUsageOID.SERVER_AUTH
        builder = (_builder(subject, issuer, key.public_key())
                   .add_extension(x509.ExtendedKeyUsage([usage]), critical=False))
        if not client:
            import ipaddress

            builder = builder.add_extension(x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                critical=False)
        cert = builder.sign(self.key, hashes.SHA256())
        encryption = (serialization.BestAvailableEncryption(password) if password
                      else serialization.NoEncryption())
        cert_path, key_path = folder / f"{name}.crt", folder / f"{name}.key"
        cert_path.write_bytes(cert.public_bytes(_PEM))
        key_path.write_bytes(key.private_bytes(_PEM, serialization.PrivateFormat.PKCS8,
                                               encryption))
        return cert_path, key_path


def _builder(subject: x509.Name, issuer: x509.Name, public_key) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer)
            .public_key(public_key).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1)))


def serial_of(der: bytes) -> int:
    """The serial number of a DER certificate (what ``getpeercert(True)`` gives)."""
    return x509.load_der_x509_certificate(der).serial_number
