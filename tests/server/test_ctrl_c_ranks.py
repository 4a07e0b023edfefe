"""Ctrl-C of ``kvledger serve -pp 2`` (or ``-tp 2``) as a terminal sends it: SIGINT to the
whole foreground process group, the rank processes included. Rank 0 drains and tells its
ranks to stop; they ignore the terminal's SIGINT (``rank_worker.terminal_interrupt_held``),
so the run ends quietly with exit 0, and no rank prints ``rank 1 failed:
KeyboardInterrupt`` (issue 52), not even one still starting its interpreter."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest
from _server_helpers import free_port, reap, wait_for_serve

NOISE = ("KeyboardInterrupt", "Traceback", "failed", "ERROR")


def _serve_in_its_own_group(model_dir, port: int) -> subprocess.Popen:
    """As a shell starts a foreground job: a process group of its own, which Ctrl-C
    signals whole (start_new_session: the group is the server's pid)."""
    return subprocess.Popen(
        [sys.executable, "-m", "kvledger.engine.cli", "serve", str(model_dir), "-pp", "2",
         "--device", "cpu", "--max-model-len", "256", "--host", "127.0.0.1",
         "--port", str(port)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def _ctrl_c(proc: subprocess.Popen) -> str:
    """SIGINT to the group, as the terminal sends it; the server's stderr once it ended,
    with every process of the group (its ranks) gone."""
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.killpg(proc.pid, 0)  # a rank of the group still alive
        except ProcessLookupError:
            return err
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGKILL)
    pytest.fail(f"a rank outlived the server: {err}")


def test_ctrl_c_of_a_serving_pipeline_ends_quietly(tiny_llama_dir) -> None:
    port = free_port()
    proc = _serve_in_its_own_group(tiny_llama_dir, port)
    try:
        wait_for_serve(proc, port)
        body = json.dumps({"model": str(tiny_llama_dir), "prompt": "Once upon",
                           "max_tokens": 4}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as answer:  # both stages ran
            assert json.load(answer)["usage"]["completion_tokens"] == 4
        err = _ctrl_c(proc)
    finally:
        reap(proc)
    assert proc.returncode == 0, err
    assert "SIGINT: draining" in err
    assert not [word for word in NOISE if word in err], err


@pytest.mark.parametrize("after_s", [0.0, 1.0, 2.0])
def test_ctrl_c_while_the_ranks_start_ends_quietly(tiny_llama_dir, after_s) -> None:
    """While rank 0 loads and its ranks import torch: no rank's KeyboardInterrupt, and no
    abort of the loading thread (the process ends at once, its ranks ended first)."""
    proc = _serve_in_its_own_group(tiny_llama_dir, free_port())
    try:
        assert "listening on" in proc.stderr.readline()
        time.sleep(after_s)
        err = _ctrl_c(proc)
    finally:
        reap(proc)
    assert proc.returncode == 0, err
    assert not [word for word in NOISE if word in err], err
