"""Play the kubelet for a hub model's pod: the rendered ``preflight``, ``fetch`` and
``engine`` containers run in order as local processes, with their env (the token from
the Secret the ``secretKeyRef`` names) and volume mounts mapped to local folders, against
the hub-compatible server of tests/hub_server.py.

A model that fits: the pre-flight passes, ``fetch`` downloads it into the cache, and the
engine serves it offline from the read-only cache without asking the hub anything. One
that does not fit: the pre-flight exits 3 having read only headers, and the kubelet never
starts ``fetch``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from _server_helpers import free_port, wait_for_serve
from hub_server import HubServer
from operator_harness import local_argv

from kvledger.engine.errors import EXIT_DOES_NOT_FIT
from kvledger.operator.render.render import render_deployment

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "bench"))
from plan_speed import write_sparse_checkpoint  # noqa: E402
from spec_helpers import spec_of  # noqa: E402

TOKEN = "hf_pod_test_token"
SECRET = {"name": "hf-token", "key": "token"}


@pytest.fixture(scope="module")
def hub(tmp_path_factory, make_model_dir):
    with HubServer() as server:
        server.add_commit("kvledger/tiny-gated", make_model_dir("tiny-llama"), token=TOKEN)
        big = tmp_path_factory.mktemp("big")
        write_sparse_checkpoint(big, 30)
        server.add_commit("kvledger/llama-3-70b-sparse", big, token=TOKEN)
        yield server


class Kubelet:
    """Runs one pod's containers as local processes, mapping mounts and env as a kubelet."""

    def __init__(self, pod_spec: dict, scratch: Path, secrets: dict[tuple[str, str], str]):
        self.pod_spec, self.scratch, self.secrets = pod_spec, scratch, secrets

    def env(self, container: dict) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
        env["HOME"] = str(self.scratch / "tmp")  # the image's HOME is /tmp, an emptyDir
        for entry in container.get("env", []):
            if "value" in entry:
                env[entry["name"]] = entry["value"]
            else:
                ref = entry["valueFrom"]["secretKeyRef"]
                env[entry["name"]] = self.secrets[(ref["name"], ref["key"])]
        return env

    def argv(self, container: dict) -> list[str]:
        volumes = {v["name"]: v for v in self.pod_spec["volumes"]}
        mounts = {}
        for mount in container["volumeMounts"]:
            local = self.scratch / volumes[mount["name"]]["name"]
            local.mkdir(parents=True, exist_ok=True)
            mounts[mount["mountPath"]] = str(local)

        return local_argv(container, mounts)

    def run(self, container: dict) -> subprocess.CompletedProcess:
        return subprocess.run(self.argv(container), env=self.env(container),
                              capture_output=True, text=True, timeout=120)


def hub_pod(hub: HubServer, repo: str, tmp_path: Path, **spec) -> tuple[dict, Kubelet]:
    from kvledger.engine.checkpoint.hub.repo import download_bytes

    uri = f"hf://{repo}"
    full = {"model": {"uri": uri, "name": "tiny", "endpoint": hub.url,
                      "tokenSecretRef": SECRET},
            "gpus": 0, **spec}
    size = download_bytes(uri, token=TOKEN, endpoint=hub.url)
    deployment = render_deployment("hub-pod", "default", spec_of(full), download_bytes=size)
    pod_spec = deployment["spec"]["template"]["spec"]
    return pod_spec, Kubelet(pod_spec, tmp_path, {(SECRET["name"], SECRET["key"]): TOKEN})




def test_a_fitting_hub_pod_fetches_once_then_serves_offline(hub, tmp_path):
    repo = "kvledger/tiny-gated"
    pod_spec, kubelet = hub_pod(hub, repo, tmp_path, engine={"maxModelLen": 256},
                                port=free_port())
    preflight, fetch = pod_spec["initContainers"]
    [engine] = pod_spec["containers"]
    assert [preflight["name"], fetch["name"]] == ["preflight", "fetch"]
    assert all(TOKEN not in json.dumps(c) for c in (preflight, fetch, engine))

    done = kubelet.run(preflight)
    assert done.returncode == 0, done.stderr
    weights = (hub.repos[repo].commits[hub.repos[repo].refs["main"]]
               / "model.safetensors").stat().st_size
    assert hub.served_bytes(repo, ".safetensors") < weights  # headers only so far
    done = kubelet.run(fetch)
    assert done.returncode == 0, done.stderr
    assert hub.served_bytes(repo, ".safetensors") >= weights  # now the weights

    port = next(p["containerPort"] for p in engine["ports"])
    argv = [a if a != "0.0.0.0" else "127.0.0.1" for a in kubelet.argv(engine)]
    env = kubelet.env(engine)
    assert env["HF_HUB_OFFLINE"] == "1" and "HF_TOKEN" not in env
    requests_before = len(hub.requests)
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        wait_for_serve(proc, port)
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions", headers={"Content-Type":
                                                                 "application/json"},
            data=json.dumps({"model": "tiny", "prompt": "Hello", "max_tokens": 4}).encode())
        with urllib.request.urlopen(request, timeout=30) as response:
            assert json.load(response)["usage"]["completion_tokens"] == 4
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert len(hub.requests) == requests_before  # the engine never asked the hub


def test_a_hub_pod_that_does_not_fit_stops_before_fetch_having_read_headers_only(hub, tmp_path):
    repo = "kvledger/llama-3-70b-sparse"
    pod_spec, kubelet = hub_pod(hub, repo, tmp_path, memory={"limit": "40Gi"})
    preflight, fetch = pod_spec["initContainers"]
    assert fetch["name"] == "fetch"
    done = kubelet.run(preflight)
    assert done.returncode == EXIT_DOES_NOT_FIT, done.stderr
    assert done.stderr.startswith("error: engine requires")
    served = hub.served_bytes(repo, ".safetensors")
    cache_limit = next(v for v in pod_spec["volumes"] if v["name"] == "model-cache")
    weights = 131.4 * 2**30
    assert served < 0.01 * weights  # under 1% of the weights: only the headers
    # A kubelet starts the next init container only after exit 0: fetch never runs, and
    # the emptyDir the operator sized for it (from the hub's file sizes) stays empty.
    assert cache_limit["emptyDir"]["sizeLimit"].endswith("Mi")
    assert not any((tmp_path / "model-cache").glob("**/*.safetensors"))
