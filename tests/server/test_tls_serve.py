"""``kvledger serve`` as a real process with vLLM's listener flags (engine/server/tls.py,
listen.py): HTTPS on the key and certificate, mutual TLS (``--ssl-ca-certs``,
``--ssl-cert-reqs 2``), ``--enable-ssl-refresh`` serving a replaced certificate without a
restart while open connections go on, and ``--uds``'s unix socket in place of the port.
Each flag was refused ("kvledger does not support vLLM's --ssl-keyfile", exit 2)."""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest
from _server_helpers import free_port, reap
from _tls_certs import Authority, serial_of


def _serve(model_dir: Path, *flags: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "kvledger.engine.cli", "serve", "--model", str(model_dir),
         "--device", "cpu", "--max-model-len", "128", "--num-gpu-blocks-override", "16",
         "--host", "127.0.0.1", *flags],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _stop(proc: subprocess.Popen) -> str:
    """SIGTERM, exit 0; its log."""
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0
    return proc.stderr.read()


def _trust(ca: Path, client: tuple[Path, Path] | None = None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(ca))
    if client is not None:
        context.load_cert_chain(*client)
    return context


def _ask(conn: http.client.HTTPConnection, path: str, body: dict | None = None):
    conn.request("POST" if body is not None else "GET", path,
                 body=json.dumps(body) if body is not None else None,
                 headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    return response.status, json.loads(response.read())


def _wait_ready(proc: subprocess.Popen, connect, timeout_s: float = 120.0) -> str:
    """Until ``connect()``'s connection answers /ready 200: the model's name."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"serve exited with {proc.returncode}: {proc.stderr.read()}")
        try:
            status, body = _ask(connect(), "/ready")
            if status == 200:
                return body["model"]
        except OSError:
            pass
        time.sleep(0.2)
    pytest.fail("serve never became ready")


def test_https_with_client_certificates_and_a_certificate_replaced_while_serving(
        tiny_llama_dir, tmp_path):
    ca, clients = Authority.make("server CA"), Authority.make("client CA")
    cert, key = ca.leaf(tmp_path, "server")
    client = clients.leaf(tmp_path, "client", client=True)
    stranger = Authority.make("another CA").leaf(tmp_path, "stranger", client=True)
    trusted = _trust(ca.write(tmp_path / "ca.pem"), client)
    port = free_port()
    proc = _serve(tiny_llama_dir, "--port", str(port), "--ssl-keyfile", str(key),
                  "--ssl-certfile", str(cert), "--ssl-ca-certs",
                  str(clients.write(tmp_path / "clients.pem")), "--ssl-cert-reqs", "2",
                  "--enable-ssl-refresh")
    try:
        def connect(context=trusted):
            return http.client.HTTPSConnection("127.0.0.1", port, context=context, timeout=10)

        model = _wait_ready(proc, connect)
        kept = connect()
        status, answer = _ask(kept, "/v1/completions", {
            "model": model, "prompt": "Once", "max_tokens": 3, "temperature": 0})
        assert status == 200 and answer["usage"]["completion_tokens"] == 3
        first_serial = serial_of(kept.sock.getpeercert(binary_form=True))
        # Mutual TLS: no certificate, or one another CA signed, gets no answer.
        for refused in (_trust(tmp_path / "ca.pem"), _trust(tmp_path / "ca.pem", stranger)):
            with pytest.raises(OSError):
                _ask(connect(refused), "/ready")

        # A renewal, as a Secret's volume does it: new files swapped in, one at a time.
        renewed = Authority.make("renewed CA")
        new_cert, new_key = renewed.leaf(tmp_path, "renewed")
        os.replace(new_key, key)
        os.replace(new_cert, cert)
        now_trusted = _trust(renewed.write(tmp_path / "renewed.pem"), client)
        deadline = time.monotonic() + 20
        while True:
            try:
                fresh = connect(now_trusted)
                assert _ask(fresh, "/ready")[0] == 200
                break
            except ssl.SSLCertVerificationError:
                assert time.monotonic() < deadline, "the renewed certificate was never served"
                time.sleep(0.2)
        assert serial_of(fresh.sock.getpeercert(binary_form=True)) != first_serial
        # The connection opened before the renewal goes on, on its first certificate.
        sock = kept.sock
        assert _ask(kept, "/ready")[0] == 200 and kept.sock is sock
        assert serial_of(sock.getpeercert(binary_form=True)) == first_serial
        log = _stop(proc)
    finally:
        reap(proc)
    assert f"listening on https://127.0.0.1:{port}" in log
    assert f"on https://127.0.0.1:{port} (context" in log  # the ready line
    assert "loaded the TLS certificate again" in log
    assert "PRIVATE KEY" not in log


async def test_uds_serves_on_the_unix_socket_instead_of_the_port(tiny_llama_dir, tmp_path):
    path = tmp_path / "kvledger.sock"
    path_stale = socket.socket(socket.AF_UNIX)  # an earlier run's socket file, left there
    path_stale.bind(str(path))
    path_stale.close()
    port = free_port()
    proc = _serve(tiny_llama_dir, "--port", str(port), "--uds", str(path))
    try:
        async with aiohttp.ClientSession(
                connector=aiohttp.UnixConnector(path=str(path))) as session:
            async def ask(route: str, body: dict | None = None):
                method = session.post if body is not None else session.get
                async with method(f"http://localhost{route}", json=body) as response:
                    return response.status, await response.json()

            deadline = time.monotonic() + 120
            while True:
                assert proc.poll() is None, proc.stderr.read()
                try:
                    status, ready = await ask("/ready")
                    if status == 200:
                        break
                except aiohttp.ClientError:
                    pass
                assert time.monotonic() < deadline, "serve never became ready"
                await asyncio.sleep(0.2)
            status, answer = await ask("/v1/completions", {
                "model": ready["model"], "prompt": "Once", "max_tokens": 2})
            assert status == 200 and answer["usage"]["completion_tokens"] == 2
        with pytest.raises(OSError):  # --host and --port are ignored, as in vLLM
            socket.create_connection(("127.0.0.1", port), timeout=2).close()
        log = _stop(proc)
    finally:
        reap(proc)
    assert f"listening on unix:{path}" in log
