"""Where ``kvledger serve`` listens: ``--host`` and ``--port`` as vLLM 0.32 binds them
(``create_server_socket``, ``vllm/entrypoints/launchers/launcher.py``), or ``--uds``'s unix
socket (``create_server_unix_socket``: host and port ignored), HTTPS on either with a TLS
context (``tls.py``).

An IPv6 address gets an ``AF_INET6`` socket with ``IPV6_V6ONLY`` off, so ``--host ::``
takes IPv4 clients too (as ``::ffff:127.0.0.1``), as vLLM's does; asyncio turns
``IPV6_V6ONLY`` on, and ``::`` would then refuse every IPv4 client. Any other host (an
IPv4 address, a name) is asyncio's server as aiohttp's ``TCPSite`` makes it.

A TLS handshake must be done within ``handshake_timeout_s`` (serve's ``--header-timeout``),
or the connection is dropped: aiohttp's own sites leave asyncio's 60 s, and a client that
opens connections and never finishes a handshake would hold each that long (~280 KiB with
TLS). The header timeout (``slow_clients.py``) starts once the handshake is done.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import ssl

from aiohttp import web

from kvledger.engine.errors import KvledgerError, plain

HANDSHAKE_TIMEOUT_S = 10.0  # serve passes its --header-timeout


def is_ipv6(host: str) -> bool:
    """Whether ``host`` is an IPv6 address (``::``, ``::1``, ``fe80::1%eth0``)."""
    try:
        return ipaddress.ip_address(host).version == 6
    except ValueError:
        return False


class _Site(web.BaseSite):
    """One asyncio server for a runner on ``address`` (``host`` and ``port``, a bound
    ``sock``, or a unix socket's ``path``), TLS handshakes bounded."""

    def __init__(self, runner: web.BaseRunner, name: str, ssl_context: ssl.SSLContext | None,
                 handshake_timeout_s: float, **address) -> None:
        super().__init__(runner, ssl_context=ssl_context)
        self._name, self._address = name, address
        self._handshake_timeout_s = handshake_timeout_s

    @property
    def name(self) -> str:
        return self._name

    async def start(self) -> None:
        await super().start()
        loop = asyncio.get_running_loop()
        options: dict = {"backlog": self._backlog}
        if self._ssl_context is not None:
            options.update(ssl=self._ssl_context,
                           ssl_handshake_timeout=self._handshake_timeout_s)
        if "path" in self._address:
            self._server = await loop.create_unix_server(
                self._runner.server, self._address["path"], **options)
        else:
            self._server = await loop.create_server(self._runner.server, **self._address,
                                                    **options)


def site(runner: web.BaseRunner, host: str, port: int,
         ssl_context: ssl.SSLContext | None = None,
         handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S) -> web.BaseSite:
    """The site ``runner`` serves ``host:port`` on (``start()`` it), HTTPS with
    ``ssl_context``; OSError when an IPv6 socket cannot be made or bound (no IPv6 here, the
    port taken)."""
    name = url(host, port, ssl_context is not None)
    if not is_ipv6(host):
        return _Site(runner, name, ssl_context, handshake_timeout_s, host=host, port=port)
    sock = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)  # dual-stack: IPv4 too
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return _Site(runner, name, ssl_context, handshake_timeout_s, sock=sock)


def unix_site(runner: web.BaseRunner, path: str, ssl_context: ssl.SSLContext | None = None,
              handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S) -> web.BaseSite:
    """The site ``runner`` serves the unix socket ``path`` on; a socket file already there
    (an earlier run's) is replaced, as asyncio's unix server does, any other file is an
    OSError on ``start()``."""
    return _Site(runner, url("", 0, ssl_context is not None, path), ssl_context,
                 handshake_timeout_s, path=path)


async def start(runner: web.BaseRunner, host: str, port: int, uds: str | None,
                ssl_context: ssl.SSLContext | None,
                handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S) -> str:
    """Serve ``runner`` on ``uds`` if given, else on ``host:port``, HTTPS with
    ``ssl_context``; where, as the log writes it (``url``). KvledgerError, one line, when
    it cannot listen there."""
    where = f"unix:{uds}" if uds is not None else f"{host}:{port}"
    try:
        serving = (unix_site(runner, uds, ssl_context, handshake_timeout_s) if uds is not None
                   else site(runner, host, port, ssl_context, handshake_timeout_s))
        await serving.start()
    except (OSError, UnicodeError) as exc:  # UnicodeError: a name IDNA cannot spell
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        raise KvledgerError(f"cannot listen on {plain(where)}: {reason}") from None
    return serving.name


def url(host: str, port: int, tls: bool = False, uds: str | None = None) -> str:
    """``http://HOST:PORT`` (``https`` with ``tls``), an IPv6 address in brackets as a URL
    writes it; ``unix:PATH`` (``https+unix:PATH`` with ``tls``) for a unix socket, as vLLM
    writes it."""
    if uds is not None:
        return f"https+unix:{uds}" if tls else f"unix:{uds}"
    scheme = "https" if tls else "http"
    return f"{scheme}://[{host}]:{port}" if is_ipv6(host) else f"{scheme}://{host}:{port}"
