"""Where ``kvledger serve`` listens (engine/server/listen.py, root_path.py): ``--host ::`` is
dual-stack as vLLM's socket (IPv4 clients were refused: asyncio set IPV6_V6ONLY), the log
writes an IPv6 address in brackets, and ``--root-path`` serves every route under its
prefix too, as FastAPI's root_path (it was refused)."""

from __future__ import annotations

import logging
import socket

import aiohttp
import pytest
from aiohttp import web

from kvledger.engine.cli import main
from kvledger.engine.server import listen
from kvledger.engine.server.root_path import serve_under
from kvledger.engine.slow_clients import limited_runner


def _has_ipv6() -> bool:
    if not socket.has_ipv6:
        return False
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as sock:
            sock.bind(("::1", 0))
    except OSError:
        return False
    return True


_SEEN = web.RequestKey("middleware_path", str)  # the path a middleware (the API keys') sees


async def _seen(request: web.Request) -> web.Response:
    return web.json_response({"path": request.path, "query": dict(request.query),
                              "middleware": request[_SEEN]})


@web.middleware
async def _records(request: web.Request, handler):
    request[_SEEN] = request.path
    return await handler(request)


async def _serving(host: str, root_path: str | None = None):
    app = web.Application(middlewares=[_records])
    app.router.add_get("/", _seen)
    app.router.add_get("/v1/models", _seen)
    runner = limited_runner(app, header_timeout_s=10, keepalive_timeout=5)
    await runner.setup()
    if root_path:
        serve_under(runner.server, root_path)
    site = listen.site(runner, host, 0)
    await site.start()
    return runner, runner.addresses[0][1]


@pytest.mark.skipif(not _has_ipv6(), reason="no IPv6 on this machine")
async def test_the_ipv6_any_address_takes_ipv4_clients_too() -> None:
    runner, port = await _serving("::")
    try:
        async with aiohttp.ClientSession() as session:
            for address in ("127.0.0.1", "[::1]"):
                async with session.get(f"http://{address}:{port}/v1/models") as response:
                    assert response.status == 200, address
    finally:
        await runner.cleanup()


def test_an_ipv6_address_is_written_in_brackets() -> None:
    assert listen.url("::", 8000) == "http://[::]:8000"
    assert listen.url("0.0.0.0", 8000) == "http://0.0.0.0:8000"
    assert listen.url("localhost", 80) == "http://localhost:80"


@pytest.mark.skipif(not _has_ipv6(), reason="no IPv6 on this machine")
def test_serve_logs_the_ipv6_address_in_brackets(tmp_path, caplog, capsys) -> None:
    caplog.set_level(logging.INFO, logger="kvledger.serve")
    code = main(["serve", "--model", str(tmp_path / "nothing"), "--device", "cpu",
                 "--host", "::", "--port", "0"])
    assert code == 2 and "Traceback" not in capsys.readouterr().err
    assert any(r.getMessage().startswith("listening on http://[::]:0;") for r in caplog.records)


async def test_root_path_serves_every_route_under_its_prefix_too() -> None:
    runner, port = await _serving("127.0.0.1", "/llama")
    base = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as session:
            for path, seen in (("/llama/v1/models?x=1", "/v1/models"),
                               ("/v1/models", "/v1/models"), ("/llama", "/"), ("/llama/", "/")):
                async with session.get(base + path) as response:
                    body = await response.json()
                assert (response.status, body["path"], body["middleware"]) == (200, seen, seen)
            async with session.get(base + "/llama/v1/models?x=1") as response:
                assert (await response.json())["query"] == {"x": "1"}
            for outside in ("/llamas/v1/models", "/llama/llama/v1/models"):
                async with session.get(base + outside) as response:
                    assert response.status == 404, outside
    finally:
        await runner.cleanup()


@pytest.mark.parametrize(("given", "message"), [
    ("llama", "expected a path prefix such as /llama"), ("/a?b", "expected a path prefix")])
def test_a_root_path_that_is_no_prefix_is_one_line(tmp_path, capsys, given, message) -> None:
    assert main(["serve", "--model", str(tmp_path), "--root-path", given]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
