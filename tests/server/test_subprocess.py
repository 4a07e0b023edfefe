"""``kvledger serve`` as a real process: ready, SIGTERM drains (503 for new work, the
in-flight stream ends cleanly after the grace), exit 0."""

from __future__ import annotations

import http.client
import json
import signal
import subprocess
import sys
import time

import pytest
from _server_helpers import free_port, reap, wait_for_serve


def _request(port: int, method: str, path: str, body: dict | None = None):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request(method, path, body=json.dumps(body) if body is not None else None,
                 headers={"Content-Type": "application/json"})
    return conn, conn.getresponse()




def test_sigterm_drains_and_exits_zero(tiny_llama_dir):
    port = free_port()
    # A 1024-token context makes each step slow enough on a CPU that the stream below is
    # still running when SIGTERM arrives (~1000 tokens to go); the 0.5 s grace aborts it.
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvledger.engine.cli", "serve", "--model", str(tiny_llama_dir),
         "--device", "cpu", "--host", "127.0.0.1", "--port", str(port),
         "--max-model-len", "1024", "--num-gpu-blocks-override", "128",
         "--shutdown-grace", "0.5"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_serve(proc, port)
        conn, ready = _request(port, "GET", "/ready")
        model = json.loads(ready.read())["model"]
        conn.close()
        stream_conn, stream = _request(port, "POST", "/v1/completions", {
            "model": model, "prompt": "Once", "stream": True, "ignore_eos": True,
            "max_tokens": None})  # the rest of the context
        assert stream.status == 200
        first = stream.readline()
        assert first.startswith(b"data: ")
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.1)
        conn, refused = _request(port, "POST", "/v1/completions",
                                 {"model": model, "prompt": "x", "max_tokens": 1})
        assert refused.status == 503
        assert json.loads(refused.read())["error"]["code"] == "shutting_down"
        conn.close()
        rest = stream.read()
        stream_conn.close()
        assert b'"finish_reason":"abort"' in rest and rest.endswith(b"data: [DONE]\n\n")
        assert proc.wait(timeout=30) == 0
    finally:
        reap(proc)


def test_serve_refuses_a_run_that_does_not_fit(tiny_llama_dir):
    result = subprocess.run(
        [sys.executable, "-m", "kvledger.engine.cli", "serve", "--model", str(tiny_llama_dir),
         "--device", "cpu", "--host", "127.0.0.1", "--port", str(free_port()),
         "--memory-limit", "1MiB"],
        capture_output=True, text=True, timeout=120)
    assert result.returncode == 3, result.stderr
    assert "Traceback" not in result.stderr


def _serve(model_dir, port: int) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "kvledger.engine.cli", "serve", "--model", str(model_dir),
         "--device", "cpu", "--host", "127.0.0.1", "--port", str(port),
         "--max-model-len", "128", "--num-gpu-blocks-override", "16", "--shutdown-grace", "0.5"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_sigint_is_named_in_the_log_and_exits_zero(tiny_llama_dir):
    """Ctrl-C sends SIGINT: the log names it (it said SIGTERM whatever arrived)."""
    port = free_port()
    proc = _serve(tiny_llama_dir, port)
    try:
        wait_for_serve(proc, port)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
        err = proc.stderr.read()
        assert "SIGINT: draining (grace 0s)" in err and "SIGTERM" not in err, err
    finally:
        reap(proc)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_during_loading_is_named_and_exits_zero(tiny_llama_dir, sig):
    """Sent as soon as /health answers, while the load thread is still importing torch;
    if the load wins the race, the draining line must name the signal just the same."""
    port = free_port()
    proc = _serve(tiny_llama_dir, port)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stderr.read()
            assert time.monotonic() < deadline, "serve never answered /health"
            try:
                conn, response = _request(port, "GET", "/health")
                conn.close()
                if response.status == 200:
                    break
            except OSError:
                time.sleep(0.01)
        proc.send_signal(sig)
        assert proc.wait(timeout=30) == 0
        err = proc.stderr.read()
        other = "SIGTERM" if sig == signal.SIGINT else "SIGINT"
        assert (f"{sig.name} received while loading; exiting" in err
                or f"{sig.name}: draining" in err), err
        assert other not in err, err
    finally:
        reap(proc)
