"""The image and the operator's pods in a real container engine (podman 4.3 ``kube play``).

The Deployments are rendered by the operator's own renderer from InferenceService
manifests validated against the CRD; only what podman 4.3 lacks is changed
(``for_podman``). Two pods, both ``gpus: 0`` (the CPU image; the pod's memory limit is
the cgroup the pre-flight plans against):

- one that fits: its pre-flight exits 0, then the engine answers ``/ready`` and a
  completion on the pod's port, as uid 1000 on a read-only root filesystem, and drains
  to exit 0 on SIGTERM;
- one that does not: its pre-flight exits 3, its log holds the breakdown and the
  remedies, the engine container never starts, and the operator's status logic turns
  what the container reported into ``MemoryBudget=False/DoesNotFit``.
"""

from __future__ import annotations

import copy
import json
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from container_harness import MEASURED, podman
from spec_helpers import spec_of

from kvledger.engine.errors import EXIT_DOES_NOT_FIT
from kvledger.operator.api.crd import API_VERSION, KIND, validate_manifest
from kvledger.operator.controller.status import MEMORY_BUDGET, READY, compute_status, find_condition
from kvledger.operator.render.render import render_deployment

pytestmark = [pytest.mark.container, pytest.mark.timeout(900)]

MOUNT = "/models"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def for_podman(deployment: dict[str, Any]) -> dict[str, Any]:
    """What podman 4.3's ``kube play`` lacks, and only that:

    - ``restartPolicy: Never``: with a Deployment's ``Always``, 4.3 restarts a succeeded
      init container in a loop and fails the pod (fixed in podman 4.6);
    - emptyDir volumes renamed per pod: 4.3 turns them into named volumes shared by every
      pod that uses the same name, so two pods would share ``plan`` and ``tmp``.
    (Not changed, though ignored by 4.3: probes, ``terminationMessagePath``; the report is
    read from the container's log, as ``FallbackToLogsOnError`` does on a cluster.)
    """
    out = copy.deepcopy(deployment)
    pod = out["spec"]["template"]["spec"]
    pod["restartPolicy"] = "Never"
    prefix = out["metadata"]["name"] + "-"
    renamed = {v["name"]: prefix + v["name"] for v in pod["volumes"] if "emptyDir" in v}
    for volume in pod["volumes"]:
        volume["name"] = renamed.get(volume["name"], volume["name"])
    for container in pod["initContainers"] + pod["containers"]:
        for mount in container.get("volumeMounts", []):
            mount["name"] = renamed.get(mount["name"], mount["name"])
    return out


def manifest(name: str, image: str, models: Path, port: int, *, engine: dict[str, Any],
             memory: str) -> dict[str, Any]:
    return validate_manifest({
        "apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": name},
        "spec": {
            "model": {"path": f"{MOUNT}/tiny-llama", "name": "tiny-llama",
                      "volume": {"hostPath": {"path": str(models)}, "mountPath": MOUNT}},
            "engine": engine, "gpus": 0, "port": port, "image": image,
            "resources": {"limits": {"memory": memory, "cpu": "1"}},
        },
    })


class PlayedPod:
    """One Deployment played with ``podman kube play``; removed on exit."""

    def __init__(self, doc: dict[str, Any], workdir: Path) -> None:
        self.name = doc["metadata"]["name"]
        self.pod = f"{self.name}-pod-0"  # kube play's name for a Deployment's pod
        deployment = render_deployment(self.name, "default", spec_of(doc["spec"]))
        self.yaml_path = workdir / f"{self.name}.yaml"
        self.yaml_path.write_text(yaml.safe_dump(for_podman(deployment)))
        self.volumes = [v["name"] for v in for_podman(deployment)["spec"]["template"]["spec"]
                        ["volumes"] if "emptyDir" in v]

    def play(self):
        return podman("kube", "play", str(self.yaml_path), check=False)

    def container(self, name: str) -> str:
        return f"{self.pod}-{name}"

    def inspect(self, name: str, template: str) -> str:
        return podman("inspect", self.container(name), "--format", template).stdout.strip()

    def logs(self, name: str) -> str:
        result = podman("logs", self.container(name), check=False)
        return result.stdout + result.stderr

    def remove(self) -> None:
        podman("pod", "rm", "--force", self.pod, check=False)
        for volume in self.volumes:
            podman("volume", "rm", "--force", volume, check=False)


@pytest.fixture
def played(tmp_path: Path) -> Iterator[list[PlayedPod]]:
    pods: list[PlayedPod] = []
    yield pods
    for pod in pods:
        pod.remove()


def http(method: str, url: str, body: dict | None = None) -> tuple[int, dict]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def wait_ready(pod: PlayedPod, port: int, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if http("GET", f"http://127.0.0.1:{port}/ready")[0] == 200:
                return
        except (urllib.error.URLError, ConnectionError, json.JSONDecodeError):
            pass
        if pod.inspect("engine", "{{.State.Status}}") == "exited":
            pytest.fail(f"the engine exited before /ready:\n{pod.logs('engine')[-3000:]}")
        time.sleep(0.25)
    pytest.fail(f"/ready not 200 after {timeout_s} s:\n{pod.logs('engine')[-3000:]}")


def test_fitting_pod_serves_as_uid_1000_on_a_read_only_root(
        image: str, models: Path, played: list[PlayedPod], tmp_path: Path) -> None:
    port = free_port()
    doc = manifest("e2e-fits", image, models, port, memory="2Gi",
                   engine={"maxModelLen": 256, "maxNumSeqs": 4})
    pod = PlayedPod(doc, tmp_path)
    played.append(pod)
    started = time.monotonic()
    result = pod.play()
    assert result.returncode == 0, result.stderr
    wait_ready(pod, port)
    MEASURED["kube play -> /ready (s)"] = time.monotonic() - started

    # The engine starts only after every init container exited 0; podman removes a
    # succeeded init container, so the pre-flight's plan on the shared volume is its trace.
    plan = json.loads(podman("exec", pod.container("engine"), "cat",
                             "/var/run/kvledger/plan.json").stdout)
    assert plan["fits"] is True
    # gpus: 0 -> the CPU, whose size is the pod's cgroup limit, not the host's memory.
    assert plan["device"]["total_bytes"] <= 2 * 2**30
    assert "cgroup" in plan["device"]["name"]

    status, body = http("POST", f"http://127.0.0.1:{port}/v1/completions",
                        {"model": "tiny-llama", "prompt": "Hello", "max_tokens": 8})
    assert status == 200, body
    assert body["usage"]["completion_tokens"] == 8
    assert body["choices"][0]["finish_reason"] == "length"

    assert podman("exec", pod.container("engine"), "id", "-u").stdout.strip() == "1000"
    assert pod.inspect("engine", "{{.HostConfig.ReadonlyRootfs}}") == "true"
    write = podman("exec", pod.container("engine"), "touch", "/opt/kvledger/x", check=False)
    assert write.returncode != 0 and "Read-only file system" in write.stderr

    # SIGTERM (what the kubelet sends) drains and exits 0.
    podman("stop", "--time", "40", pod.container("engine"))
    assert pod.inspect("engine", "{{.State.ExitCode}}") == "0"
    assert "SIGTERM: draining" in pod.logs("engine")


def test_refused_pod_stops_at_its_preflight_with_the_breakdown(
        image: str, models: Path, played: list[PlayedPod], tmp_path: Path) -> None:
    # 512 sequences of 1024 tokens need 1 GiB of KV; the pod's 1.5 GiB leave about 1 GiB
    # after the runtime context and the safety margin.
    doc = manifest("e2e-refused", image, models, free_port(), memory="1536Mi",
                   engine={"maxModelLen": 1024, "maxNumSeqs": 512, "maxNumBatchedTokens": 512})
    pod = PlayedPod(doc, tmp_path)
    played.append(pod)
    result = pod.play()
    assert result.returncode == 125, result.stdout + result.stderr
    assert "exited with code 3" in result.stderr

    assert pod.inspect("preflight", "{{.State.ExitCode}}") == str(EXIT_DOES_NOT_FIT)
    report = pod.logs("preflight")
    for line in ("error: engine requires", "weights", "activations", "KV cache",
                 "cuda graphs", "runtime context", "KV pool:", "to fit within",
                 "--max-model-len", "--max-num-seqs", "host memory (cgroup limit)"):
        assert line in report, f"{line!r} missing from the pre-flight's log:\n{report}"
    # The engine container was created but never started.
    assert pod.inspect("engine", "{{.State.Status}}") == "created"
    assert pod.inspect("engine", "{{.State.StartedAt.IsZero}}") == "true"

    # What a kubelet would report (FallbackToLogsOnError: the log, as podman 4.3 writes no
    # termination log), through the operator's status logic.
    pod_status = {"initContainerStatuses": [{"name": "preflight", "state": {"terminated": {
        "exitCode": EXIT_DOES_NOT_FIT, "reason": "Error", "message": report}}}]}
    status = compute_status(spec=spec_of(doc["spec"]), generation=1, old={}, pods=[pod_status],
                            spec_error=None, endpoint="", now="2026-01-01T00:00:00Z")
    budget = find_condition(status["conditions"], MEMORY_BUDGET)
    assert (budget["status"], budget["reason"]) == ("False", "DoesNotFit")
    assert "--max-num-seqs" in budget["message"]
    assert find_condition(status["conditions"], READY)["reason"] == "DoesNotFit"
    assert status["plan"]["shortBy"]


def test_the_image_runs_the_operator_and_the_planner(image: str) -> None:
    """One image for all three roles: ``operator`` without a cluster is a one-line exit 2."""
    result = podman("run", "--rm", "--read-only", "--tmpfs", "/tmp", image, "operator",
                    check=False)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.strip().startswith("error:") and "\n" not in result.stderr.strip()
    plan = podman("run", "--rm", "--read-only", "--tmpfs", "/tmp", image, "plan", "--help")
    assert "--memory-limit" in plan.stdout
    labels = json.loads(podman("image", "inspect", image, "--format",
                               "{{json .Labels}}").stdout)
    assert labels["org.opencontainers.image.title"] == "kvledger"
    user = podman("image", "inspect", image, "--format", "{{.User}}").stdout.strip()
    assert user == "1000:1000"
