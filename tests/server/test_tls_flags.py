"""vLLM's HTTPS and unix-socket flags on ``kvledger serve`` (engine/server/tls.py): a TLS
flag that cannot serve as asked is one ``error:`` line and exit 2 before the model loads,
naming the flag and the file, never a key's content; ``plan`` and ``preflight`` take them
as serve's own; and a renewal half written never replaces the pair being served."""

from __future__ import annotations

import asyncio
import ssl
from pathlib import Path

import pytest
from _tls_certs import Authority, serial_of
from aiohttp import web

from kvledger.engine.cli import main
from kvledger.engine.server import listen, tls


@pytest.fixture
def pair(tmp_path) -> tuple[Authority, Path, Path]:
    ca = Authority.make()
    return ca, *ca.leaf(tmp_path, "server")


def _bad_cases(tmp_path: Path, ca: Authority, cert: Path, key: Path) -> list:
    _, other_key = ca.leaf(tmp_path, "other")
    locked_cert, locked_key = ca.leaf(tmp_path, "locked", password=b"secret-password")
    junk = tmp_path / "junk.pem"
    junk.write_text("not a PEM file\n")
    ca_file = str(ca.write(tmp_path / "ca.pem"))
    return [
        (["--ssl-keyfile", str(key)], "--ssl-keyfile needs --ssl-certfile"),
        (["--ssl-certfile", str(cert)], f"--ssl-certfile {cert} holds no private key"),
        (["--ssl-certfile", str(tmp_path / "absent.crt"), "--ssl-keyfile", str(key)],
         f"--ssl-certfile {tmp_path / 'absent.crt'}: cannot read it (No such file"),
        (["--ssl-certfile", str(cert), "--ssl-keyfile", str(tmp_path)],
         f"--ssl-keyfile {tmp_path}: cannot read it (Is a directory)"),
        (["--ssl-certfile", str(cert), "--ssl-keyfile", str(other_key)],
         f"--ssl-keyfile {other_key} is not the key of --ssl-certfile {cert}'s certificate"),
        (["--ssl-certfile", str(key), "--ssl-keyfile", str(key)],
         f"--ssl-certfile {key} holds no PEM certificate"),
        (["--ssl-certfile", str(cert), "--ssl-keyfile", str(junk)],
         f"--ssl-keyfile {junk} holds no PEM private key"),
        (["--ssl-certfile", str(locked_cert), "--ssl-keyfile", str(locked_key)],
         f"--ssl-keyfile {locked_key}: the key is encrypted"),
        (["--ssl-certfile", str(cert), "--ssl-keyfile", str(key), "--ssl-cert-reqs", "3"],
         "--ssl-cert-reqs 3: must be 0 (no client certificate), 1 (optional) or 2"),
        (["--ssl-certfile", str(cert), "--ssl-keyfile", str(key), "--ssl-cert-reqs", "2"],
         "--ssl-cert-reqs 2 needs --ssl-ca-certs"),
        (["--ssl-certfile", str(cert), "--ssl-keyfile", str(key), "--ssl-ca-certs", str(key),
          "--ssl-cert-reqs", "2"], f"--ssl-ca-certs {key} holds no PEM certificate"),
        (["--ssl-ca-certs", ca_file, "--ssl-cert-reqs", "2"], "--ssl-ca-certs needs "
         "--ssl-certfile (the server's certificate): without it serve speaks plain HTTP"),
        (["--ssl-certfile", str(cert), "--ssl-keyfile", str(key), "--ssl-ciphers", "NONE-SUCH"],
         "--ssl-ciphers NONE-SUCH: OpenSSL selects no cipher from it"),
        (["--enable-ssl-refresh"], "--enable-ssl-refresh needs --ssl-certfile"),
        (["--uds", str(tmp_path / "no" / "such" / "folder.sock")],
         f"cannot listen on unix:{tmp_path / 'no' / 'such' / 'folder.sock'}: No such file"),
    ]


def test_a_tls_flag_that_cannot_serve_is_one_line_before_the_model_loads(
        tmp_path, capsys, pair) -> None:
    ca, cert, key = pair
    model = tmp_path / "no-model-here"  # never reached: the flags are refused first
    for flags, message in _bad_cases(tmp_path, ca, cert, key):
        code = main(["serve", "--model", str(model), "--device", "cpu", "--host", "127.0.0.1",
                     "--port", "0", *flags])
        err = capsys.readouterr().err
        assert code == (1 if flags[0] == "--uds" else 2), (flags, err)
        assert err.startswith("error: ") and message in err and err.count("\n") == 1, err
        assert "PRIVATE KEY" not in err and "secret-password" not in err


@pytest.mark.parametrize("command", ["plan", "preflight"])
def test_plan_takes_them_as_serves_own(tiny_llama_dir, tmp_path, capsys, command) -> None:
    extra = ["--plan-out", str(tmp_path / "plan.json"),
             "--termination-log", str(tmp_path / "log")] if command == "preflight" else []
    flags = ["--ssl-keyfile", "/tls/tls.key", "--ssl-certfile", "/tls/tls.crt",
             "--ssl-ca-certs", "/tls/ca.crt", "--ssl-cert-reqs", "2", "--ssl-ciphers",
             "ECDHE-RSA-AES256-GCM-SHA384", "--enable-ssl-refresh", "--uds", "/run/k.sock"]
    assert main([command, str(tiny_llama_dir), "--device", "cpu", *flags, *extra]) == 0, \
        capsys.readouterr().err
    assert main([command, str(tiny_llama_dir), "--device", "cpu", "--ssl-cert-reqs", "9",
                 *extra]) == 2
    assert "--ssl-cert-reqs 9: must be 0" in capsys.readouterr().err


async def _served_serial(port: int, ca: Authority) -> int:
    trust = ssl.create_default_context(cadata=ca.pem().decode())
    _, writer = await asyncio.open_connection("127.0.0.1", port, ssl=trust)
    try:
        return serial_of(writer.get_extra_info("ssl_object").getpeercert(binary_form=True))
    finally:
        writer.close()


async def test_a_half_written_renewal_keeps_the_pair_being_served(tmp_path, pair) -> None:
    """A certificate whose key is not written yet does not load: loaded into the live
    context (as vLLM's refresher does), it would drop the key and fail every handshake."""
    ca, cert, key = pair
    files = tls.TlsFiles(str(cert), str(key))
    context = tls.server_context(files)
    runner = web.AppRunner(web.Application())
    await runner.setup()
    follower = None
    try:
        await listen.start(runner, "127.0.0.1", 0, None, context)
        port = runner.addresses[0][1]
        first = await _served_serial(port, ca)
        follower = asyncio.create_task(tls.follow(context, files, poll_s=0.02))
        await asyncio.sleep(0.05)  # it has looked at the files as they were
        new_cert, new_key = ca.leaf(tmp_path, "renewed")
        cert.write_bytes(new_cert.read_bytes())  # the certificate first, its key not yet
        await asyncio.sleep(0.2)
        assert await _served_serial(port, ca) == first
        key.write_bytes(new_key.read_bytes())
        for _ in range(100):
            if await _served_serial(port, ca) != first:
                break
            await asyncio.sleep(0.02)
        assert await _served_serial(port, ca) == serial_of_pem(new_cert)
    finally:
        if follower is not None:
            follower.cancel()
        await runner.cleanup()


def serial_of_pem(path: Path) -> int:
    return serial_of(ssl.PEM_cert_to_DER_cert(path.read_text()))


async def test_a_tls_handshake_not_done_in_time_is_dropped(pair) -> None:
    """asyncio's own deadline, which aiohttp's sites keep, is 60 s: a client that opens
    connections and never finishes a handshake held each that long."""
    _, cert, key = pair
    runner = web.AppRunner(web.Application())
    await runner.setup()
    try:
        await listen.start(runner, "127.0.0.1", 0, None,
                           tls.server_context(tls.TlsFiles(str(cert), str(key))),
                           handshake_timeout_s=0.3)
        reader, writer = await asyncio.open_connection("127.0.0.1", runner.addresses[0][1])
        writer.write(b"\x16\x03\x01")  # the start of a ClientHello, and no more
        assert await asyncio.wait_for(reader.read(), timeout=5) == b""  # closed
        writer.close()
    finally:
        await runner.cleanup()


def test_the_log_names_https_and_the_socket() -> None:
    assert listen.url("127.0.0.1", 8443, tls=True) == "https://127.0.0.1:8443"
    assert listen.url("::", 8443, tls=True) == "https://[::]:8443"
    assert listen.url("0.0.0.0", 80, uds="/run/k.sock") == "unix:/run/k.sock"
