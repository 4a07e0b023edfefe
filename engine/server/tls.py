"""HTTPS for ``kvledger serve`` (``--ssl-*``), as vLLM 0.32 hands its flags to uvicorn
(``uvicorn.config.create_ssl_context``): a server context on the key and certificate, the
client-certificate demand (``ssl.VerifyMode``) checked against the CA file, the cipher
list; and ``--enable-ssl-refresh`` as vLLM's ``SSLCertRefresher``: the files loaded again
into the same context when they change, so new handshakes get them while open connections
go on.

Where it differs from vLLM, it says so at start rather than later: every file is read and
checked before the model loads, each problem one line naming the flag and the path (never
a key's content); a key that needs a password is refused (vLLM has no password flag, and
OpenSSL would prompt on a terminal the pod does not have); a demand for client
certificates without ``--ssl-ca-certs`` (every handshake would fail) and a TLS flag without
a certificate (uvicorn ignores it and serves plain HTTP) are refused. A changed file is
loaded only once the set loads whole into a scratch context: loading a certificate whose
key is not written yet into the live context would drop its key (OpenSSL clears a key that
does not match), and every handshake would fail until the key came.
"""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
from dataclasses import dataclass

from kvledger.engine.errors import BadInput, plain

log = logging.getLogger("kvledger.serve")
POLL_S = 1.0  # how often --enable-ssl-refresh looks at the files (as the objectives file)


@dataclass(frozen=True)
class TlsFiles:
    """What serve's TLS is made of: the certificate (and its key, unless the certificate's
    file holds it), the CA file clients' certificates are checked against, the demand for
    them (0 none, 1 optional, 2 required) and the cipher list."""

    certfile: str
    keyfile: str | None = None
    ca_certs: str | None = None
    cert_reqs: int = 0
    ciphers: str | None = None

    @classmethod
    def of(cls, listener) -> TlsFiles | None:
        """The TLS a ``ListenerConfig`` asks for (None: plain HTTP); BadInput for a
        combination that cannot work as asked."""
        given = [flag for flag, value in (
            ("--ssl-keyfile", listener.ssl_keyfile), ("--ssl-ca-certs", listener.ssl_ca_certs),
            ("--ssl-cert-reqs", listener.ssl_cert_reqs), ("--ssl-ciphers", listener.ssl_ciphers),
            ("--enable-ssl-refresh", listener.enable_ssl_refresh)) if value]
        if listener.ssl_certfile is None:
            if given:
                raise BadInput(f"{given[0]} needs --ssl-certfile (the server's certificate): "
                               "without it serve speaks plain HTTP")
            return None
        if listener.ssl_cert_reqs and listener.ssl_ca_certs is None:
            raise BadInput(f"--ssl-cert-reqs {listener.ssl_cert_reqs} needs --ssl-ca-certs: "
                           "the CA certificates clients' certificates are checked against")
        return cls(listener.ssl_certfile, listener.ssl_keyfile, listener.ssl_ca_certs,
                   listener.ssl_cert_reqs, listener.ssl_ciphers)

    def flagged(self) -> list[tuple[str, str]]:
        """Each file given, with its flag."""
        return [(flag, path) for flag, path in (
            ("--ssl-certfile", self.certfile), ("--ssl-keyfile", self.keyfile),
            ("--ssl-ca-certs", self.ca_certs)) if path is not None]


@dataclass(frozen=True)
class ServerTls:
    """serve's TLS, checked: its files, the context they are loaded in, and whether they
    are followed (``--enable-ssl-refresh``)."""

    files: TlsFiles
    context: ssl.SSLContext
    refresh: bool = False

    @classmethod
    def of(cls, listener) -> ServerTls | None:
        """The TLS a ``ListenerConfig`` asks for, its files read (None: plain HTTP);
        BadInput, one line, for anything that cannot serve as asked."""
        files = TlsFiles.of(listener)
        if files is None:
            return None
        return cls(files, server_context(files), listener.enable_ssl_refresh)


class _EncryptedKey(Exception):
    """OpenSSL asked for a key's password."""


def _no_password() -> str:
    raise _EncryptedKey


def server_context(files: TlsFiles) -> ssl.SSLContext:
    """A TLS server context on ``files`` (uvicorn's: ``PROTOCOL_TLS_SERVER``, OpenSSL's
    ciphers unless given); BadInput, one line naming the flag and path, for a file that
    cannot be read or holds the wrong thing."""
    for flag, path in files.flagged():
        try:
            with open(path, "rb") as file:
                file.read(1)
        except OSError as exc:
            raise BadInput(f"{flag} {plain(path)}: cannot read it ({exc.strerror or exc})") from None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    load_chain(context, files)
    context.verify_mode = ssl.VerifyMode(files.cert_reqs)
    if files.ca_certs is not None:
        load_ca(context, files.ca_certs)
    if files.ciphers is not None:
        try:
            context.set_ciphers(files.ciphers)
        except ssl.SSLError:
            raise BadInput(f"--ssl-ciphers {plain(files.ciphers)}: OpenSSL selects no cipher "
                           "from it") from None
    return context


def load_chain(context: ssl.SSLContext, files: TlsFiles) -> None:
    """The certificate and its key into ``context``; BadInput saying which file is wrong."""
    cert = f"--ssl-certfile {plain(files.certfile)}"
    try:  # a certificate at all? (a scratch store, so the key's errors are told apart)
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cafile=files.certfile)
    except (ssl.SSLError, ValueError):
        raise BadInput(f"{cert} holds no PEM certificate") from None
    try:
        context.load_cert_chain(files.certfile, files.keyfile, password=_no_password)
    except _EncryptedKey:
        where = (f"--ssl-keyfile {plain(files.keyfile)}" if files.keyfile is not None
                 else cert)
        raise BadInput(f"{where}: the key is encrypted; give it unencrypted (vLLM's flags "
                       "have no key password)") from None
    except ssl.SSLError as exc:
        if files.keyfile is None:
            raise BadInput(f"{cert} holds no private key matching its certificate; give "
                           "--ssl-keyfile") from None
        key = f"--ssl-keyfile {plain(files.keyfile)}"
        if exc.reason == "KEY_VALUES_MISMATCH":
            raise BadInput(f"{key} is not the key of {cert}'s certificate") from None
        raise BadInput(f"{key} holds no PEM private key") from None


def load_ca(context: ssl.SSLContext, path: str) -> None:
    """The CA certificates clients' certificates are checked against, into ``context``."""
    try:
        context.load_verify_locations(cafile=path)
    except (ssl.SSLError, ValueError):
        raise BadInput(f"--ssl-ca-certs {plain(path)} holds no PEM certificate") from None


def _stamp(path: str | None) -> tuple[int, ...] | None:
    """What changes when a file is rewritten or replaced (a Secret's volume swaps a link)."""
    if path is None:
        return None
    try:
        seen = os.stat(path)
    except OSError:
        return None
    return seen.st_dev, seen.st_ino, seen.st_mtime_ns, seen.st_size


async def follow(context: ssl.SSLContext, files: TlsFiles, poll_s: float = POLL_S) -> None:
    """Until cancelled, load ``files`` again into ``context`` when they change (the
    certificate and key together, the CA file on its own); a set that does not load whole
    is logged and the context keeps what it had, until the files change again. A CA no
    longer in the file stays trusted until restart, as in vLLM (OpenSSL only adds)."""
    seen = [_stamp(files.certfile), _stamp(files.keyfile), _stamp(files.ca_certs)]
    while True:
        await asyncio.sleep(poll_s)
        now = [_stamp(files.certfile), _stamp(files.keyfile), _stamp(files.ca_certs)]
        if now == seen:
            continue
        chain, ca = now[:2] != seen[:2], now[2] != seen[2]
        seen = now
        try:
            server_context(files)  # all of it, in a scratch context first
            if chain:
                load_chain(context, files)
            if ca and files.ca_certs is not None:
                load_ca(context, files.ca_certs)
        except BadInput as exc:
            log.warning("TLS files changed but do not load (%s); serving the ones loaded "
                        "before", exc)
        else:
            log.info("loaded the TLS %s again", " and ".join(
                [what for what, changed in (("certificate", chain), ("CA", ca)) if changed]))
