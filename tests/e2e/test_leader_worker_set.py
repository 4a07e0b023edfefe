"""A ``nodes: 2`` InferenceService's LeaderWorkerSet, its two pods played in podman as the
LWS controller would make them (``lws_harness.group_pods``: names, labels, the group
size annotation and the ``LWS_*`` env in every container), on the CPU (``gpus: 0``, one
rank a pod, a pipeline stage each). Only what podman 4.3 lacks is changed
(``lws_harness.for_podman``: no cluster DNS, no ``$(VAR)`` expansion, no Secrets).

The leader's pre-flight passes, its engine waits for the worker's rank, the worker pod
joins over the pod network, a completion's greedy tokens equal one process's, and a
worker that dies ends the leader's engine with exit 1 within seconds, which is what
``RecreateGroupOnPodRestart`` recreates the group on.
"""

from __future__ import annotations

import json
import secrets
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from container_harness import MEASURED, podman
from lws_harness import WORKER_INDEX_LABEL, for_podman, group_pods
from spec_helpers import spec_of

from kvledger.engine.llm import LLM
from kvledger.engine.sampling.params import SamplingParams
from kvledger.operator.api.crd import API_VERSION, KIND, validate_manifest
from kvledger.operator.render.render_group import render_leader_worker_set

pytestmark = [pytest.mark.container, pytest.mark.timeout(900)]

MOUNT = "/models"
NAME = "e2e-group"
PROMPT = [1, 5, 9, 33, 7, 21, 2]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def pods() -> Iterator[list[str]]:
    names: list[str] = []
    yield names
    for name in names:
        podman("pod", "rm", "--force", name, check=False)
    for volume in podman("volume", "ls", "--format", "{{.Name}}").stdout.split():
        if volume.startswith(NAME):
            podman("volume", "rm", "--force", volume, check=False)


def _state(container: str, field: str) -> str:
    return podman("inspect", container, "--format", "{{.State." + field + "}}",
                  check=False).stdout.strip()


def _logs(container: str) -> str:
    result = podman("logs", container, check=False)
    return (result.stdout + result.stderr)[-3000:]


def _complete(port: int) -> list[int]:
    body = json.dumps({"model": "tiny-llama", "prompt": PROMPT, "max_tokens": 8,
                       "temperature": 0, "ignore_eos": True, "logprobs": 0,
                       "return_tokens_as_token_ids": True}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        tokens = json.loads(response.read())["choices"][0]["logprobs"]["tokens"]
    return [int(t.removeprefix("token_id:")) for t in tokens]


def _wait_ready(port: int, leader: str, worker: str, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=5) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError):
            pass
        for container in (leader, worker):
            if _state(container, "Status") == "exited":
                pytest.fail(f"{container} exited before /ready:\n{_logs(container)}\n"
                            f"{_logs(leader if container == worker else worker)}")
        time.sleep(0.5)
    pytest.fail(f"/ready not 200 after {timeout_s} s:\n{_logs(leader)}\n{_logs(worker)}")


def test_a_two_pod_group_serves_the_tokens_of_one_process(
        image: str, models: Path, pods: list[str], tmp_path: Path) -> None:
    port = free_port()
    doc = validate_manifest({
        "apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": NAME},
        "spec": {
            "model": {"path": f"{MOUNT}/tiny-llama", "name": "tiny-llama",
                      "volume": {"hostPath": {"path": str(models)}, "mountPath": MOUNT}},
            "engine": {"maxModelLen": 128, "maxNumSeqs": 4, "dtype": "float32"},
            "gpus": 0, "nodes": 2, "port": port, "image": image,
            "resources": {"limits": {"memory": "2Gi", "cpu": "1"}},
        },
    })
    lws = render_leader_worker_set(NAME, "default", spec_of(doc["spec"]),
                                   key_secret=f"{NAME}-nodes-e2e00")
    leader_pod, worker_pod = group_pods(lws)
    assert worker_pod["metadata"]["labels"][WORKER_INDEX_LABEL] == "1"
    key = {f"{NAME}-nodes-e2e00": {"key": secrets.token_hex(32)}}

    started = time.monotonic()
    leader_name, worker_name = leader_pod["metadata"]["name"], worker_pod["metadata"]["name"]
    leader, worker = f"{leader_name}-engine", f"{worker_name}-engine"
    (tmp_path / "leader.yaml").write_text(yaml.safe_dump(for_podman(
        leader_pod, leader_address=leader_pod["spec"]["hostname"], secrets=key,
        http_port=port)))
    pods.append(leader_name)
    played = podman("kube", "play", str(tmp_path / "leader.yaml"), check=False)
    assert played.returncode == 0, played.stdout + played.stderr
    ip = podman("exec", leader, "python3", "-c", "import socket; "
                "print(socket.gethostbyname(socket.gethostname()))").stdout.strip()
    (tmp_path / "worker.yaml").write_text(yaml.safe_dump(for_podman(
        worker_pod, leader_address=ip, secrets=key, http_port=port)))
    pods.append(worker_name)
    played = podman("kube", "play", str(tmp_path / "worker.yaml"), check=False)
    assert played.returncode == 0, played.stdout + played.stderr
    _wait_ready(port, leader, worker)
    MEASURED["group: kube play -> /ready (s)"] = time.monotonic() - started

    llm = LLM(str(models / "tiny-llama"), device="cpu", dtype="float32", max_model_len=128)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    assert _complete(port) == llm.generate([PROMPT], params)[0].outputs[0].token_ids
    assert "2 ranks ready on 2 machines" in _logs(leader)

    # The worker's rank dies: the leader's engine fails (exit 1), so the group restarts.
    killed = time.monotonic()
    podman("kill", "--signal", "KILL", worker)
    while _state(leader, "Status") != "exited" and time.monotonic() - killed < 30:
        time.sleep(0.2)
    MEASURED["group: worker killed -> leader exit (s)"] = time.monotonic() - killed
    assert _state(leader, "ExitCode") == "1", _logs(leader)
    assert time.monotonic() - killed < 15
    assert "is gone" in _logs(leader)
