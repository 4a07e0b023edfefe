"""``kvledger serve``'s HTTP listener: where it listens (host and port, or a unix socket), its
TLS (HTTPS, client certificates), the keys that open it, how long a slow client may hold a
connection (and a request's grammar may take to compile), and the SIGTERM drain. One of
the parts ``ServeConfig`` (``serve_config.py``) is made of; its fields come first in
serve's flags and the pod's.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvledger.engine.settings.declare import Crd, setting
from kvledger.engine.settings.kinds import ON, PATH, SECONDS, SECONDS_OR_ZERO, SWITCH, TEXT
from kvledger.engine.settings.serve_values import (
    BODY_BYTES,
    CERT_REQS,
    LAST_WORDS,
    PORT,
    ROOT_PATH,
    SERVER,
)


@dataclass(frozen=True)
class ListenerConfig:
    """The listener's options, each declared once (``setting``); checked and used as part of
    ``ServeConfig``."""

    host: str = setting(
        "0.0.0.0", "--host", TEXT, group=SERVER,
        help="the address to listen on (default %(default)s: every IPv4 interface; '::' every "
             "IPv6 and IPv4 one, as vLLM's)")
    port: int = setting(
        8000, "--port", PORT, group=SERVER, help="the port to listen on (default %(default)s)",
        crd=Crd("", "HTTP port of the engine and the Service", schema={"maximum": 65535},
                defaulted=True))
    uds: str | None = setting(  # server/listen.py
        None, "--uds", PATH, metavar="PATH", group=SERVER,
        help="vLLM's: serve on this unix domain socket instead (--host and --port are then "
             "ignored, as vLLM's); a socket file left there by an earlier run is replaced")
    # TLS (server/tls.py): uvicorn's options as vLLM passes them on; the files are read and
    # checked at start, before the model loads. Not in the CRD: a gateway or the Service's
    # ingress terminates TLS in a cluster.
    ssl_keyfile: str | None = setting(
        None, "--ssl-keyfile", PATH, metavar="PATH", group=SERVER,
        help="vLLM's: serve HTTPS with this PEM private key (not encrypted: vLLM has no "
             "password flag) and --ssl-certfile's certificate")
    ssl_certfile: str | None = setting(
        None, "--ssl-certfile", PATH, metavar="PATH", group=SERVER,
        help="vLLM's: serve HTTPS with this PEM certificate (its chain after it; the key "
             "too when --ssl-keyfile is not given, as uvicorn reads it)")
    ssl_ca_certs: str | None = setting(
        None, "--ssl-ca-certs", PATH, metavar="PATH", group=SERVER,
        help="vLLM's: the PEM CA certificates that clients' certificates are checked "
             "against (with --ssl-cert-reqs 1 or 2)")
    ssl_cert_reqs: int = setting(
        0, "--ssl-cert-reqs", CERT_REQS, group=SERVER,
        help="vLLM's (uvicorn's ssl.VerifyMode): whether a client must show a certificate "
             "that --ssl-ca-certs signs: 0 no (default), 1 optional (checked if shown), 2 "
             "required (mutual TLS)")
    ssl_ciphers: str | None = setting(
        None, "--ssl-ciphers", TEXT, metavar="CIPHERS", group=SERVER,
        help="vLLM's: the OpenSSL cipher list for TLS 1.2 and below (e.g. "
             "ECDHE-RSA-AES256-GCM-SHA384); TLS 1.3's suites are OpenSSL's own (default: "
             "OpenSSL's)")
    enable_ssl_refresh: bool = setting(
        False, "--enable-ssl-refresh", SWITCH, group=SERVER,
        help="vLLM's: load the key, certificate and CA files again when they change "
             "(looked at every second): new connections get them, open ones are kept")
    root_path: str | None = setting(  # server/root_path.py
        None, "--root-path", ROOT_PATH, group=SERVER,
        help="vLLM's: the path prefix a path-routing proxy serves the API under (e.g. "
             "/llama): a request under it is served as the path after it (/llama/v1/models "
             "is /v1/models), and one outside it as it is, as FastAPI's root_path")
    api_keys: tuple[str, ...] = setting(  # serve adds $KVLEDGER_API_KEY's and the file's
        (), "--api-key", LAST_WORDS, metavar="KEY", group=SERVER,
        help="require 'Authorization: Bearer KEY' on /v1/*, /tokenize and /detokenize; "
             "several keys, listed, each open it; as in vLLM a later --api-key (the "
             "command line's after a --config file's) replaces an earlier one (default: "
             "$KVLEDGER_API_KEY and vLLM's $VLLM_API_KEY; unset = no key)")
    api_key_file: str | None = setting(
        None, "--api-key-file", TEXT, metavar="PATH", group=SERVER,
        help="more API keys, one per line (blank lines and # comments skipped), e.g. a "
             "mounted Secret")
    salt_cache_per_key: bool = setting(
        False, "--cache-salt-per-key", ON, group=SERVER,
        help="key the prefix cache by API key too: requests under different keys never share "
             "KV blocks, so none can tell from its timing what another key's clients sent")
    metrics_api_key: str | None = setting(  # serve reads $KVLEDGER_METRICS_API_KEY if unset
        None, "--metrics-api-key", TEXT, metavar="KEY", group=SERVER,
        help="require 'Authorization: Bearer KEY' on /metrics and /v1/budget, whose "
             "prefix-cache counters tell how much of a guessed prompt was cached, and no "
             "tenant's key then opens them (default: $KVLEDGER_METRICS_API_KEY; unset: "
             "/metrics open, as Prometheus expects, /v1/budget behind the API keys)")
    shutdown_grace_s: float = setting(  # vLLM's --shutdown-timeout (its default is 0)
        30, "--shutdown-grace", SECONDS_OR_ZERO, aliases=("--shutdown-timeout",), group=SERVER,
        help="on SIGTERM, let in-flight requests run this long before aborting them, as "
             "vLLM's --shutdown-timeout (0: abort them at once; default %(default)s)",
        crd=Crd("", "on SIGTERM (scale-down, rollout, eviction), how long in-flight requests "
                    "may finish before they are aborted (--shutdown-grace); the pod's grace is "
                    "20 s more", name="shutdownGraceSeconds",
                schema={"type": "integer", "maximum": 3600}, defaulted=True))
    max_body_bytes: int = setting(
        4 * 2**20, "--max-body-bytes", BODY_BYTES, group=SERVER,
        help="larger request bodies get 413 (default 4MiB)")
    # Slow clients: a request's headers must arrive within this of its first byte (or of the
    # connection opening), its body within this of its headers; an idle keep-alive
    # connection closes after the last. 75 s outlasts the 60 s idle timeout of common load
    # balancers, so they, not the server, close idle connections (no race on reuse).
    header_timeout_s: float = setting(
        10.0, "--header-timeout", SECONDS, group=SERVER,
        help="close a connection whose request headers (or, with TLS, its handshake) take "
             "longer than this (default %(default)g)")
    body_timeout_s: float = setting(
        30.0, "--body-timeout", SECONDS, group=SERVER,
        help="answer 408 to a request whose body takes longer than this after its headers "
             "(default %(default)g)")
    # A client that reads none of an answer while the server holds more than the socket's
    # buffer of it (a 30 MB /tokenize answer) keeps that in memory: this drops it.
    write_timeout_s: float = setting(
        60.0, "--write-timeout", SECONDS, group=SERVER,
        help="close a connection whose client has read nothing of its answer for this long "
             "while the server waits to write more (default %(default)g)")
    keepalive_timeout_s: float = setting(
        75.0, "--keepalive-timeout", SECONDS_OR_ZERO, group=SERVER,
        help="close a keep-alive connection idle this long (default %(default)g; 0: one "
             "request per connection)")
    # A client's 570 KiB anyOf took about 2 s on one core; typical schemas take milliseconds.
    grammar_compile_timeout_s: float = setting(
        10.0, "--grammar-compile-timeout", SECONDS, group=SERVER,
        help="a structured-output schema whose grammar takes longer than this to compile is "
             "a 400 (default %(default)g)")
