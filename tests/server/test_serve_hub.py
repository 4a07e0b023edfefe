"""``kvledger serve --model hf://...``: served from the hub cache that ``kvledger fetch``
filled, offline as the pod's engine container runs it; downloaded first when online."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.error
import urllib.request

import pytest
from _hub_helpers import hub_env, kvledger, one_error_line, point_hub_at
from _server_helpers import free_port, wait_for_serve
from hub_server import HubServer

from kvledger.engine.settings.config import EngineConfig

URI = "hf://kvledger/tiny-llama"


@pytest.fixture(scope="module")
def hub(tiny_llama_dir):
    with HubServer() as server:
        server.add_commit("kvledger/tiny-llama", tiny_llama_dir)
        yield server




def _get_json(url: str, body: dict | None = None) -> tuple[int, dict]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as exc:
        return exc.code, json.load(exc)




def test_fetch_then_serve_offline_answers_a_completion(hub, tmp_path) -> None:
    cache = str(tmp_path / "cache")
    env = hub_env(hub.url, tmp_path / "home")
    offline = env | {"HF_HUB_OFFLINE": "1"}
    serve = ["serve", "--model", URI, "--download-dir", cache, "--device", "cpu",
             "--max-model-len", "256", "--host", "127.0.0.1"]
    line = one_error_line(kvledger(offline, *serve, "--port", str(free_port())))
    assert line == (f"error: {URI} is not in the hub cache {cache} and HF_HUB_OFFLINE=1 forbids "
                    f"downloading it: run `kvledger fetch --model {URI} --download-dir {cache}` "
                    "first")
    assert kvledger(env, "fetch", "--model", URI, "--download-dir", cache).returncode == 0
    requests_before = len(hub.requests)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "kvledger.engine.cli", *serve, "--port",
                             str(port)], env=offline, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        wait_for_serve(proc, port)
        status, answer = _get_json(base + "/v1/completions",
                                   {"model": URI, "prompt": "Hello", "max_tokens": 8})
        assert status == 200, answer
        assert answer["model"] == URI and answer["usage"]["completion_tokens"] == 8
        model = _get_json(base + "/v1/budget")[1]["plan"]["model"]
        assert model["uri"] == URI
        assert model["commit"] == hub.repos["kvledger/tiny-llama"].refs["main"]
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert len(hub.requests) == requests_before  # offline: the hub never heard of it


def test_online_engine_downloads_what_is_missing(hub, tmp_path, monkeypatch) -> None:
    from kvledger.engine.core.engine import LLMEngine

    point_hub_at(monkeypatch, hub.url, tmp_path)
    cache = tmp_path / "cache"
    engine = LLMEngine.from_config(EngineConfig(model=URI, download_dir=str(cache),
                                                device="cpu", max_model_len=128))
    assert engine.model_name == URI
    assert engine.plan.source.path.startswith(str(cache))
    assert engine.plan.to_json()["model"]["uri"] == URI
    assert (cache / "models--kvledger--tiny-llama" / "refs" / "main").is_file()
