"""Where ``kvledger serve`` listens: ``--host`` and ``--port`` as vLLM 0.32 binds them
(``create_server_socket``, ``vllm/entrypoints/launchers/launcher.py``).

An IPv6 address gets an ``AF_INET6`` socket with ``IPV6_V6ONLY`` off, so ``--host ::``
takes IPv4 clients too (as ``::ffff:127.0.0.1``), as vLLM's does; asyncio (aiohttp's
``TCPSite``) turns ``IPV6_V6ONLY`` on, and ``::`` would then refuse every IPv4 client.
Any other host (an IPv4 address, a name) is aiohttp's ``TCPSite`` as before.
"""

from __future__ import annotations

import ipaddress
import socket

from aiohttp import web


def is_ipv6(host: str) -> bool:
    """Whether ``host`` is an IPv6 address (``::``, ``::1``, ``fe80::1%eth0``)."""
    try:
        return ipaddress.ip_address(host).version == 6
    except ValueError:
        return False


def site(runner: web.BaseRunner, host: str, port: int) -> web.BaseSite:
    """The site ``runner`` serves ``host:port`` on (``start()`` it); OSError when an IPv6
    socket cannot be made or bound (no IPv6 here, the port taken)."""
    if not is_ipv6(host):
        return web.TCPSite(runner, host, port)
    sock = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)  # dual-stack: IPv4 too
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return web.SockSite(runner, sock)


def url(host: str, port: int) -> str:
    """``http://HOST:PORT``, an IPv6 address in brackets as a URL writes it."""
    return f"http://[{host}]:{port}" if is_ipv6(host) else f"http://{host}:{port}"
