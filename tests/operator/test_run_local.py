"""``kvledger run SERVICE.yaml``: validate, pre-flight (refusal -> exit 3), then serve."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml
from _server_helpers import free_port
from spec_helpers import spec_of

from kvledger.engine.cli import main as kvledger
from kvledger.engine.errors import EXIT_BAD_INPUT, EXIT_DOES_NOT_FIT
from kvledger.operator.api.spec import parse_spec
from kvledger.operator.local_run import local_config, local_model_path, serve_argv

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
TINY_EXAMPLES = sorted(p.name for p in EXAMPLES.glob("*.yaml") if "tiny-llama" in p.read_text())


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("models") / "tiny-llama"
    assert kvledger(["make-model", "tiny-llama", str(path)]) == 0
    return path


def write(tmp_path: Path, doc: dict | str, name: str = "service.yaml") -> str:
    path = tmp_path / name
    path.write_text(doc if isinstance(doc, str) else yaml.safe_dump(doc))
    return str(path)


def manifest(**spec) -> dict:
    body = {"model": {"path": "/models/tiny-llama", "name": "tiny"}}
    body.update(spec)
    return {"apiVersion": "kvledger.dev/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": "local"}, "spec": body}


@pytest.mark.parametrize("example", TINY_EXAMPLES)
def test_examples_preflight_locally(example, tiny_model, capsys):
    code = kvledger(["run", str(EXAMPLES / example), "--preflight-only",
                     "--model-path", str(tiny_model)])
    out, err = capsys.readouterr()
    if example == "does-not-fit.yaml":
        assert code == EXIT_DOES_NOT_FIT
        assert "pre-flight refused the plan" in err
        assert "error: engine requires" in err and "limit is 64.0 MiB" in err
        assert out == ""
    else:
        assert code == 0, err
        assert "pre-flight passed" in out and "fits: engine requires" in out


def test_hostpath_maps_the_pod_path_to_the_node_path():
    spec = manifest()["spec"]
    spec["model"]["volume"] = {"hostPath": {"path": "/srv/models"}, "mountPath": "/models"}
    assert local_model_path(spec_of(spec)) == "/srv/models/tiny-llama"
    spec["model"]["path"] = "/models"
    assert local_model_path(spec_of(spec)) == "/srv/models"
    spec["model"]["volume"] = {"persistentVolumeClaim": {"claimName": "m"}}
    assert local_model_path(spec_of(spec)) == "/models"  # no local meaning: taken as is


def test_run_reads_the_model_through_the_hostpath_volume(tiny_model, tmp_path, capsys):
    doc = manifest(memory={"limit": "2Gi"}, gpus=0)
    doc["spec"]["model"]["volume"] = {"hostPath": {"path": str(tiny_model.parent)},
                                      "mountPath": "/models"}
    assert kvledger(["run", write(tmp_path, doc), "--preflight-only"]) == 0
    assert "limit: --memory-limit 2.0 GiB" in capsys.readouterr().out


@pytest.mark.parametrize(("quantity", "expected"), [
    ("2Gi", 2 * 2**30), ("2G", 2 * 10**9), ("2000M", 2 * 10**9), ("512Mi", 512 * 2**20),
    (1073741824, 2**30), ("1073741824", 2**30), ("1e9", 10**9), ("1.5Gi", 3 * 2**29),
    ("2048Ki", 2 * 2**20), ("1000k", 10**6), ("1500m", 2),  # millis round up, as Kubernetes
])
def test_the_container_memory_limit_is_read_as_a_kubernetes_quantity(quantity, expected):
    config = local_config(spec_of(manifest(gpus=0, resources={"limits": {"memory": quantity}})["spec"]))
    assert config.container_memory_limit_bytes == expected
    assert config.memory_limit_bytes is None  # the device's size, not a cap


def test_a_gpus_0_memory_limit_too_small_is_refused_as_the_pod_would_be(tiny_model, tmp_path,
                                                                        capsys):
    doc = manifest(gpus=0, resources={"limits": {"memory": "64Mi"}})
    doc["spec"]["model"]["path"] = str(tiny_model)
    assert kvledger(["run", write(tmp_path, doc), "--preflight-only"]) == EXIT_DOES_NOT_FIT
    err = capsys.readouterr().err
    # 64 MiB less what the process holds, less the 0.5 GiB margin: nothing left.
    assert "error: engine requires" in err and "limit is 0.0 GiB" in err
    assert ("limit: free memory less a 0.5 GiB safety margin (host memory (container limit), "
            "64.0 MiB total") in err


@pytest.mark.parametrize("method", ["bitsandbytes", "mxfp4"])
def test_a_quantized_checkpoint_is_refused_by_the_preflight_before_serve(tmp_path, capsys,
                                                                       monkeypatch, method):
    """`kvledger run` pre-flights as the pod does: a quantized checkpoint is one line,
    exit 2, and serve is never started (it would crash at loading)."""
    from budget_checkpoints import write_quantized

    from kvledger.engine.checkpoint.model_config import SERVED_WEIGHTS
    from kvledger.operator import local_run

    def no_serve(*args, **kwargs):
        raise AssertionError("serve was started")

    monkeypatch.setattr(local_run, "_exec_serve", no_serve)
    write_quantized(tmp_path / "model", method)
    doc = manifest(gpus=0)
    doc["spec"]["model"]["path"] = str(tmp_path / "model")
    assert kvledger(["run", write(tmp_path, doc)]) == EXIT_BAD_INPUT
    out, err = capsys.readouterr()
    assert err == (f"error: checkpoint is quantized with {method!r} "
                   f"(quantization_config.quant_method); {SERVED_WEIGHTS}\n")
    assert "pre-flight passed" not in out


def test_a_roomy_gpus_0_memory_limit_fits_and_is_the_devices_size(tiny_model, tmp_path, capsys):
    doc = manifest(gpus=0, resources={"limits": {"memory": "4Gi"}})
    doc["spec"]["model"]["path"] = str(tiny_model)
    assert kvledger(["run", write(tmp_path, doc), "--preflight-only"]) == 0
    out = capsys.readouterr().out
    assert "fits: engine requires" in out
    assert "(host memory (container limit), 4.0 GiB total" in out
    flags = local_config(spec_of(doc["spec"])).to_flags()
    assert flags[flags.index("--container-memory-limit") + 1] == str(4 * 2**30)
    assert "--memory-limit" not in flags


def test_model_path_is_normalised_and_dotdot_is_refused_by_run_and_operator():
    from kvledger.engine.errors import BadInput
    from kvledger.operator.render.render import engine_flags

    spec = manifest()["spec"]
    spec["model"]["path"] = "/models/./tiny-llama/"
    spec["model"]["volume"] = {"hostPath": {"path": "/srv/models"}, "mountPath": "/models/"}
    assert parse_spec(spec).engine.model == "/models/tiny-llama"
    assert local_model_path(spec_of(spec)) == "/srv/models/tiny-llama"
    spec["model"]["path"] = "/models/../etc"  # was /srv/etc here, /etc in the pod
    with pytest.raises(BadInput, match=r"must not contain a '\.\.' segment"):
        local_config(spec_of(spec))
    with pytest.raises(BadInput, match=r"must not contain a '\.\.' segment"):
        engine_flags(spec_of(spec))


def test_local_device_is_the_cpu_only_when_the_spec_has_no_gpus():
    assert local_config(spec_of(manifest(gpus=0)["spec"])).device == "cpu"
    assert local_config(spec_of(manifest(gpus=1)["spec"])).device == "auto"
    assert local_config(spec_of(manifest()["spec"]), "/elsewhere").model == "/elsewhere"


@pytest.mark.parametrize(("doc", "expected"), [
    (manifest(engine={"maxModelLen": 1024, "maxNumSeqs": 0}),
     "spec.engine.maxNumSeqs: 0 is less than the minimum of 1"),
    (manifest(memory={"limit": "lots"}), "spec.memory.limit: 'lots' does not match"),
    (manifest(memory={"gpuMemoryUtilization": 1.5}),
     "spec.memory.gpuMemoryUtilization: 1.5 is greater than the maximum of 1"),
    (manifest(engine={"dtype": "int3"}), "spec.engine.dtype: 'int3' is not one of"),
    (manifest(engine={"maxModelLen": 1024, "maxModelLength": 9}),
     "spec.engine: unknown field(s) ('maxModelLength' was unexpected)"),
    (manifest(engine={"maxNumSeqs": 32, "maxNumBatchedTokens": 16}),
     "maxNumBatchedTokens must be at least maxNumSeqs"),
    (manifest(memory={"limit": "0Gi"}), "memory.limit must be more than 0 bytes"),
    (manifest(model={"path": "/models/../etc", "volume": {"hostPath": {"path": "/srv"}}}),
     "model.path must not contain a '..' segment"),
    (manifest(resources={"limits": {"memory": "lots"}}),
     "spec.resources.limits.memory: 'lots' is not a Kubernetes quantity"),
    (manifest(resources={"limits": {"memory": "2GiB"}}),
     "spec.resources.limits.memory: '2GiB' is not a Kubernetes quantity"),
    (manifest(resources={"limits": {"memory": "1e99"}}),
     "spec.resources.limits.memory: '1e99' is out of range"),
    (manifest(resources={"limits": {"memory": 0}}),
     "spec.resources.limits.memory must be more than 0 bytes"),
    ({**manifest(), "metadata": {"name": "Bad_Name"}},
     "metadata.name: 'Bad_Name': metadata.name must be a DNS-1035 label of at most 63"),
    ({**manifest(), "metadata": {"name": "llama-3.1-8b"}},
     "the operator names the Service in front of the pods after the resource"),
    (manifest(resources={"limits": {"nvidia.com/gpu": "2"}}),
     "resources.limits and resources.requests take no GPU (nvidia.com/gpu, amd.com/gpu, ...): "
     "set spec.gpus"),
    (manifest(gpus=0, resources={"requests": {"amd.com/gpu": 1}}), "set spec.gpus, the GPUs"),
    # KServe's ways to name a model, each answered with kvledger's.
    (manifest(model={"uri": "hf://org/m:main"}), "write hf://ORG/NAME@REVISION"),
    (manifest(model={"uri": "https://huggingface.co/org/m"}),
     "a hub model is hf://ORG/NAME[@REVISION], not its web page"),
    (manifest(model={"uri": "pvc://claim/models/m"}),
     "model.path (its directory, under model.volume.mountPath) with "
     "model.volume.persistentVolumeClaim.claimName"),
    (manifest(model={"uri": "gs://bucket/m"}), "mount the checkpoint as a volume"),
    ({"apiVersion": "serving.kserve.io/v1beta1", "kind": "InferenceService",
      "metadata": {"name": "m"}, "spec": {"predictor": {"model": {
          "modelFormat": {"name": "huggingface"}, "storageUri": "hf://org/m",
          "args": ["--max-model-len=4096"], "resources": {"limits": {"nvidia.com/gpu": "1"}}}}}},
     "predictor.model.storageUri is spec.model.uri"),
    (manifest(gpus=9), "gpus must be at most 8: kvledger serves a model on the GPUs of one"),
    (manifest(model={"uri": "hf://org/m", "path": "/m"}),
     "set exactly one of model.path and model.uri"),
    # The schema's pattern is the engine's regex; the engine's parser says the rest.
    (manifest(model={"uri": "hf://org/m@"}),
     "spec.model.uri: bad hub model 'hf://org/m@': the revision after '@' must be a branch"),
    (manifest(model={"uri": "hf://-org/m"}),
     "spec.model.uri: bad hub model 'hf://-org/m': '-org' may not start or end with '.' or '-'"),
    (manifest(model={"uri": "s3://org/m"}),
     "spec.model.uri: model.uri: s3://, gs://, oci:// and hdfs:// are not supported"),
    (manifest(model={"path": "/models/m", "volume": {"hostPath": {"path": "/srv"},
                                                     "mountPath": "/data"}}),
     "model.path must lie under model.volume.mountPath"),
    (manifest(tolerations=[{"key": "k", "operator": "Exists", "value": "v"}]),
     "a toleration with operator Exists takes no value"),
    (manifest(nodeSelector={"pool": 1}), "spec.nodeSelector.pool: 1 is not of type 'string'"),
    (manifest(autoscaling={"minReplicas": 0, "maxReplicas": 3}),
     "autoscaling.minReplicas 0 (scale to zero) needs provider keda"),
    (manifest(autoscaling={"maxReplicas": 3, "target": "2"}),
     "autoscaling.target of kvReservedRatio is a share of the KV pool: at most 1"),
    (manifest(autoscaling={"maxReplicas": 3, "target": 0.8}),
     'spec.autoscaling.target: 0.8 is neither an integer nor a string (write a decimal as a '
     'string, e.g. "0.8")'),
    ({**manifest(), "kind": "Deployment"}, "manifest must be apiVersion: kvledger.dev/v1alpha1"),
    ({k: v for k, v in manifest().items() if k != "spec"},
     "invalid InferenceService at (top level): 'spec' is a required property"),
])
def test_bad_manifests_are_one_line_errors_with_exit_2(doc, expected, tmp_path, capsys):
    assert kvledger(["run", write(tmp_path, doc), "--preflight-only"]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert expected in err


@pytest.mark.parametrize(("text", "expected"), [
    ("spec: [unclosed", "is not valid YAML at line 1"),
    ("---\nkind: A\n---\nkind: B\n", "must hold exactly one InferenceService, found 2"),
])
def test_unreadable_files_are_one_line_errors(text, expected, tmp_path, capsys):
    assert kvledger(["run", write(tmp_path, text), "--preflight-only"]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and expected in err


@pytest.mark.parametrize(("text", "expected"), [
    ("[" * 200_000, "nests deeper than 64 levels"),
    ("spec:\n" + "".join("  " * i + f"k{i}:\n" for i in range(1, 80)) + "  " * 80 + "v: 1\n",
     "nests deeper than 64 levels"),
    ("# padding\n" * 200_000, "is over 1536 KiB: too large for a manifest"),
], ids=["200KB-of-brackets", "deep-mapping", "2MB"])
def test_oversized_and_overnested_manifests_are_one_line_errors(text, expected, tmp_path,
                                                                 capsys):
    started = time.monotonic()
    assert kvledger(["run", write(tmp_path, text), "--preflight-only"]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err[:300]
    assert expected in err and "Traceback" not in err
    assert time.monotonic() - started < 10  # refused from the first bytes, not parsed whole


def test_a_binary_file_is_a_one_line_error(tmp_path, capsys):
    path = tmp_path / "service.yaml"
    path.write_bytes(b"\xff\xfe\x00garbage")
    assert kvledger(["run", str(path), "--preflight-only"]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is not UTF-8 text" in err


def test_missing_file_and_missing_model(tmp_path, capsys):
    assert kvledger(["run", str(tmp_path / "nope.yaml")]) == EXIT_BAD_INPUT
    assert "cannot read" in capsys.readouterr().err
    doc = manifest()
    doc["spec"]["model"]["path"] = str(tmp_path / "absent")
    assert kvledger(["run", write(tmp_path, doc), "--preflight-only"]) == EXIT_BAD_INPUT
    assert "does not exist" in capsys.readouterr().err


def test_serve_gets_the_flags_the_pod_gets(tiny_model):
    spec = manifest(engine={"maxModelLen": 512, "kvCacheDtype": "fp8"},
                    memory={"limit": "1Gi"})["spec"]
    flags = local_config(spec_of(spec), str(tiny_model)).to_flags()
    argv = serve_argv(flags, "127.0.0.1", 9000, spec_of(spec))
    assert argv[1:4] == ["-m", "kvledger.engine.cli", "serve"]
    assert argv[4:-6] == flags
    assert flags[flags.index("--max-model-len") + 1] == "512"
    assert flags[flags.index("--memory-limit") + 1] == str(2**30)
    assert flags[flags.index("--served-model-name") + 1] == "tiny"
    assert argv[-2:] == ["--shutdown-grace", "30"]  # the line: serve's own defaults
    # spec.shutdownGraceSeconds and maxQueueWaitSeconds are serve's here as in the pod.
    spec.update(shutdownGraceSeconds=90, maxQueueWaitSeconds=5, maxQueueLength=7)
    assert serve_argv(flags, "127.0.0.1", 9000, spec_of(spec))[-6:] == \
        ["--shutdown-grace", "90", "--max-queue-wait", "5", "--max-queue-len", "7"]
    # The tenants' line settings too; their file is a cluster's Secret (ignored here).
    spec.update(maxQueueLengthPerTenant=3, tenantFairness=False,
                tenantsSecretRef={"name": "tenants", "key": "tenants.yaml"})
    assert serve_argv(flags, "127.0.0.1", 9000, spec_of(spec))[-3:] == \
        ["--max-queue-len-per-tenant", "3", "--no-tenant-fairness"]




def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status, response.read()
    except OSError:
        return 0, b""


def _run_until_ready(path: str, port: int, limit_s: float) -> subprocess.Popen:
    """``kvledger run PATH --port PORT`` (its output on a pipe), once it answers /ready."""
    proc = subprocess.Popen([sys.executable, "-m", "kvledger.engine.cli", "run", path,
                             "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + limit_s
    try:
        while _get(f"http://127.0.0.1:{port}/ready")[0] != 200:
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "never became ready"
            time.sleep(0.2)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return proc


@pytest.mark.timeout(120)
def test_run_serves_the_manifest_and_stops_on_sigterm(tiny_model, tmp_path):
    port = free_port()
    doc = manifest(engine={"maxModelLen": 256, "maxNumSeqs": 2}, memory={"limit": "1Gi"},
                   gpus=0, resources={"limits": {"memory": "4Gi"}})
    doc["spec"]["model"]["path"] = str(tiny_model)
    proc = _run_until_ready(write(tmp_path, doc), port, 90)
    try:
        status, body = _get(f"http://127.0.0.1:{port}/v1/models")
        assert status == 200
        assert [m["id"] for m in json.loads(body)["data"]] == ["tiny"]
        # The exec'd engine read host memory as the pod's cgroup would show it.
        device = json.loads(_get(f"http://127.0.0.1:{port}/v1/budget")[1])["plan"]["device"]
        assert device["name"] == "host memory (container limit)"
        assert device["total_bytes"] == 4 * 2**30
        proc.send_signal(signal.SIGTERM)  # exec'd: the server itself gets it
        assert proc.wait(timeout=30) == 0
        output = proc.stdout.read()
        assert "local: pre-flight passed" in output and "exec kvledger serve" in output
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.timeout(180)
def test_run_serves_a_group_of_nodes_as_processes_of_this_machine(tiny_model, tmp_path):
    """``nodes: 2`` (a LeaderWorkerSet group on a cluster): machine 0 serves, machine 1
    runs stage 2 headless; the tokens are one process's; SIGTERM to machine 0 stops both."""
    from kvledger.engine.llm import LLM
    from kvledger.engine.sampling.params import SamplingParams

    port = free_port()
    doc = manifest(engine={"maxModelLen": 128, "maxNumSeqs": 2, "dtype": "float32"},
                   gpus=0, nodes=2)
    doc["spec"]["model"]["path"] = str(tiny_model)
    proc = _run_until_ready(write(tmp_path, doc), port, 120)
    try:
        body = json.dumps({"model": "tiny", "prompt": [1, 5, 9, 33], "max_tokens": 6,
                           "temperature": 0, "ignore_eos": True, "logprobs": 0,
                           "return_tokens_as_token_ids": True}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                         {"Content-Type": "application/json"})
        answer = json.loads(urllib.request.urlopen(request, timeout=60).read())
        tokens = [int(t.removeprefix("token_id:"))
                  for t in answer["choices"][0]["logprobs"]["tokens"]]
        llm = LLM(str(tiny_model), device="cpu", dtype="float32", max_model_len=128)
        params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
        assert tokens == llm.generate([[1, 5, 9, 33]], params)[0].outputs[0].token_ids
        budget = json.loads(_get(f"http://127.0.0.1:{port}/v1/budget")[1])["plan"]
        assert budget["pipeline_parallel_size"] == 2
        proc.send_signal(signal.SIGTERM)  # machine 0, exec'd: it stops machine 1
        assert proc.wait(timeout=30) == 0
        output = proc.stdout.read()
        assert "machine 1 of 2: kvledger serve --node-rank 1 --headless" in output
        assert "ranks ready on 2 machines" in output
        deadline = time.monotonic() + 15
        while _group_left(tiny_model) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _group_left(tiny_model), "machine 1 outlived machine 0"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in _group_left(tiny_model):
            subprocess.run(["kill", "-9", str(pid)], check=False)


def test_each_machine_of_a_local_group_gets_gpus_of_its_own():
    from kvledger.engine.errors import BadInput
    from kvledger.operator.local_run import _gpus_of

    assert _gpus_of({}, 0, 1) == {}  # the CPU
    assert _gpus_of({}, 2, 1)["CUDA_VISIBLE_DEVICES"] == "2,3"
    visible = {"CUDA_VISIBLE_DEVICES": "4,5,6,7"}
    assert [_gpus_of(visible, 2, r)["CUDA_VISIBLE_DEVICES"] for r in (0, 1)] == ["4,5", "6,7"]
    with pytest.raises(BadInput, match="machine 2 finds no 2 GPUs of its own"):
        _gpus_of(visible, 2, 2)


def _group_left(model: Path) -> list[int]:
    """The pids of machine 1's processes still running (their command line names the
    model and --headless)."""
    found = []
    for status in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            argv = status.read_bytes().split(b"\0")
        except OSError:
            continue
        if str(model).encode() in argv and b"--headless" in argv:
            found.append(int(status.parent.name))
    return found


def test_cluster_only_fields_are_validated_then_ignored_and_it_says_so(tiny_model, tmp_path,
                                                                       capsys):
    doc = manifest(gpus=0, nodeSelector={"pool": "a"}, tolerations=[{"operator": "Exists"}],
                   env=[{"name": "NCCL_DEBUG", "value": "INFO"}], podLabels={"team": "x"})
    doc["spec"]["model"]["path"] = str(tiny_model)
    assert kvledger(["run", write(tmp_path, doc), "--preflight-only"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("local: ignored off the cluster: spec.nodeSelector, spec.tolerations, "
                          "spec.env, spec.podLabels\n")
    assert "pre-flight passed" in out
    assert "time to ready: reading the weights ~" in out  # timed on the model's folder


def test_autoscaling_is_validated_then_ignored_off_the_cluster(tiny_model, tmp_path, capsys):
    """One process serves locally: there is nothing to scale, and a line says so."""
    doc = manifest(gpus=0, replicas=3, autoscaling={
        "provider": "keda", "minReplicas": 0, "maxReplicas": 4, "metric": "rejectionRate",
        "target": "0.5", "prometheus": {"serverAddress": "http://prom:9090"}})
    doc["spec"]["model"]["path"] = str(tiny_model)
    assert kvledger(["run", write(tmp_path, doc), "--preflight-only"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("local: ignored off the cluster: spec.autoscaling\n")
    assert "pre-flight passed" in out


def test_an_inference_pool_is_validated_then_ignored_off_the_cluster(tiny_model, tmp_path,
                                                                    capsys):
    """No gateway routes to one process: the pool is the cluster's, and a line says so."""
    doc = manifest(gpus=0, inferencePool={"endpointPicker": {"name": "epp"}})
    doc["spec"]["model"]["path"] = str(tiny_model)
    assert kvledger(["run", write(tmp_path, doc), "--preflight-only"]) == 0
    assert capsys.readouterr().out.startswith(
        "local: ignored off the cluster: spec.inferencePool\n")
    doc["spec"]["inferencePool"] = {"endpointPicker": {"name": "Not_A_Name"}}
    assert kvledger(["run", write(tmp_path, doc), "--preflight-only"]) == 2


def test_sleep_is_validated_then_ignored_off_the_cluster(tiny_model, tmp_path, capsys):
    """spec.sleep is the cluster's ConfigMap; locally serve gets no sleep file (sleep mode
    stays on: POST /sleep in development mode), and a line says so."""
    from kvledger.operator.local_run import serve_argv

    doc = manifest(gpus=0, engine={"enableSleepMode": True}, sleep=1)
    doc["spec"]["model"]["path"] = str(tiny_model)
    assert kvledger(["run", write(tmp_path, doc), "--preflight-only"]) == 0
    assert capsys.readouterr().out.startswith("local: ignored off the cluster: spec.sleep\n")
    argv = serve_argv(["--enable-sleep-mode"], "127.0.0.1", 8001, spec_of(doc["spec"]))
    assert "--enable-sleep-mode" in argv and "--sleep-level-file" not in argv


def test_a_hub_model_is_preflighted_and_served_by_its_uri(tmp_path, capsys, monkeypatch):
    """The uri goes to the pod's own pre-flight and to serve as --model; the Secret, mirror
    and cache of the manifest are the cluster's (the shell's HF_TOKEN applies here)."""
    from kvledger.engine.commands import preflight as cli_preflight

    ran, execs = [], []

    def preflight(args):
        ran.append(args)
        print("fits: engine requires 1.0 GiB, limit is 2.0 GiB (1.0 GiB to spare)")
        return 0

    monkeypatch.setattr(cli_preflight, "main", preflight)
    monkeypatch.setattr("os.execv", lambda path, argv: execs.append(argv))
    doc = manifest(gpus=0, model={
        "uri": "hf://org/m@v1", "name": "m", "tokenSecretRef": {"name": "hf", "key": "token"},
        "endpoint": "https://mirror.example", "cache": {
            "persistentVolumeClaim": {"claimName": "c"}}})
    assert kvledger(["run", write(tmp_path, doc), "--port", "9001"]) == 1  # execv was faked
    out = capsys.readouterr().out
    assert out.splitlines()[0] == ("local: ignored off the cluster: spec.model.tokenSecretRef, "
                                   "spec.model.endpoint, spec.model.cache")
    [args] = ran
    assert (args.model, args.served_model_name, args.device) == ("hf://org/m@v1", ["m"], "cpu")
    assert args.download_dir is None  # the engine's default cache
    [argv] = execs
    assert argv[4:6] == ["--model", "hf://org/m@v1"] and "--download-dir" not in argv
    assert "local: pre-flight passed" in out and "exec kvledger serve --model hf://org/m@v1" in out


def test_a_hub_model_that_does_not_fit_exits_3(tmp_path, capsys, monkeypatch):
    from kvledger.engine.commands import preflight as cli_preflight

    monkeypatch.setattr(cli_preflight, "main", lambda args: EXIT_DOES_NOT_FIT)
    doc = manifest(gpus=0, model={"uri": "hf://org/m"})
    assert kvledger(["run", write(tmp_path, doc)]) == EXIT_DOES_NOT_FIT
    assert "local: pre-flight refused the plan" in capsys.readouterr().err


def test_a_hub_model_with_model_path_runs_the_local_copy(tiny_model, tmp_path, capsys):
    doc = manifest(gpus=0, model={"uri": "hf://org/tiny", "name": "tiny"})
    assert kvledger(["run", write(tmp_path, doc), "--preflight-only",
                     "--model-path", str(tiny_model)]) == 0
    assert "fits: engine requires" in capsys.readouterr().out
