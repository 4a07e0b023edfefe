"""Hub models (``hf://``): planned from headers read over HTTP, fetched into the cache, and
every bad input one ``error:`` line, exit 2; against tests/hub_server.py on 127.0.0.1.

Each command runs as a subprocess with its own HF_HOME, HF_ENDPOINT and no HF_TOKEN, as a
pod would run it; the hub's answers and the bytes it sent are checked on the server."""

from __future__ import annotations

import argparse
import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from _hub_helpers import hub_env, kvledger, one_error_line, point_hub_at
from budget_checkpoints import write_checkpoint
from hub_server import HubServer, closed_port_url

from kvledger.engine.checkpoint.hub.repo import HubModel, download_bytes, is_hub_uri, parse_uri
from kvledger.engine.errors import BadInput
from kvledger.engine.settings.config_flags import config_from_args
from kvledger.operator.api.crd import validate_manifest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
from plan_speed import write_sparse_checkpoint  # noqa: E402

TOKEN = "hf_kvledger_test_token"
BIG = "kvledger/llama-3-70b-sparse"


@pytest.fixture(scope="module")
def hub(tmp_path_factory, make_model_dir):
    root = tmp_path_factory.mktemp("hub")
    with HubServer() as server:
        server.add_commit("kvledger/tiny-llama", make_model_dir("tiny-llama"))
        server.add_commit("kvledger/tiny-gated", make_model_dir("tiny-llama"), token=TOKEN)
        sharded = root / "sharded"
        write_checkpoint(sharded, shards=2)
        server.add_commit("kvledger/tiny-sharded", sharded)
        (big := root / "big").mkdir()
        write_sparse_checkpoint(big, 30)
        server.add_commit(BIG, big)
        (bins := root / "bins").mkdir()
        (bins / "config.json").write_text((sharded / "config.json").read_text())
        (bins / "pytorch_model.bin").write_bytes(b"\0" * 64)
        server.add_commit("kvledger/no-safetensors", bins)
        gpt2 = root / "gpt2"
        write_checkpoint(gpt2, shards=1, architectures=["GPT2LMHeadModel"])
        server.add_commit("kvledger/gpt2-shaped", gpt2)
        yield server


# -- the uri ------------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "repo_id", "revision", "uri"), [
    ("hf://org/name", "org/name", "main", "hf://org/name"),
    ("hf://meta-llama/Llama-3.1-8B@v1.0", "meta-llama/Llama-3.1-8B", "v1.0",
     "hf://meta-llama/Llama-3.1-8B@v1.0"),
    ("hf://Qwen/Qwen2.5-0.5B-Instruct@" + "a" * 40, "Qwen/Qwen2.5-0.5B-Instruct", "a" * 40,
     "hf://Qwen/Qwen2.5-0.5B-Instruct@" + "a" * 40),
    ("hf://org/name@refs/pr/1", "org/name", "refs/pr/1", "hf://org/name@refs/pr/1"),
    ("hf://org/name@main", "org/name", "main", "hf://org/name"),
])
def test_parse_uri(text, repo_id, revision, uri) -> None:
    model = parse_uri(text)
    assert (model.repo_id, model.revision, model.uri) == (repo_id, revision, uri)
    assert model == HubModel(repo_id, revision) and parse_uri(model.uri) == model
    assert is_hub_uri(text) and not is_hub_uri("/models/org/name")


@pytest.mark.parametrize("text", [
    "hf://", "hf://name", "hf://org/", "hf://org/name/extra", "hf://org/name@", "hf://org/na me",
    "hf://-org/name", "hf://org/name.", "hf://org/na..me", "hf://org/na--me", "hf://org/name@a@b",
    "hf://org/name@../x", "hf://org/name@/x", "hf://org/name@x/", "hf://org/name@a b",
    "hf://" + "o" * 97 + "/name", "hf://org/name@-x",
])
def test_malformed_uri_is_one_line_bad_input(text) -> None:
    with pytest.raises(BadInput) as err:
        parse_uri(text)
    assert "\n" not in str(err.value) and repr(text) in str(err.value)


def test_a_malformed_uri_is_refused_by_every_verb(tmp_path) -> None:
    env = hub_env(closed_port_url(), tmp_path)
    for verb in ("plan", "preflight", "fetch", "serve"):
        line = one_error_line(kvledger(env, verb, "--model", "hf://org/na me"))
        assert "expected hf://ORG/NAME[@REVISION]" in line, (verb, line)


# -- plan and preflight from headers ----------------------------------------------------


def test_refusing_a_70b_model_reads_under_1_percent_of_it(hub, tmp_path) -> None:
    hub.served.clear()
    result = kvledger(hub_env(hub.url, tmp_path), "plan", "--model", f"hf://{BIG}",
                      "--device-memory", "192GiB", "--max-model-len", "8192",
                      "--max-num-seqs", "64")
    assert result.returncode == 3, result.stderr
    assert result.stderr.startswith("error: engine requires 294.8 GiB, limit is 188.2 GiB")
    assert "    --max-num-seqs 21 " in result.stderr
    weights = sum(p.stat().st_size for p in hub.repos[BIG].commits[hub.repos[BIG].refs["main"]]
                  .glob("*.safetensors"))
    sent = hub.served_bytes(BIG, ".safetensors")
    assert 0 < sent < weights / 100, (sent, weights)
    assert sent < 30 * 200_000  # a header (one or two Range requests) per shard
    # Every weight GET is a Range request (the resolve URL redirects to the "CDN").
    assert all(status in (206, 302) for method, path, _, status in hub.requests
               if method == "GET" and path.endswith(".safetensors"))


def test_plan_json_names_the_uri_and_the_commit(hub, tmp_path) -> None:
    env = hub_env(hub.url, tmp_path)
    result = kvledger(env, "plan", "--model", "hf://kvledger/tiny-sharded@main", "--device",
                      "cpu", "--max-model-len", "256", "--json")
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["model"]["uri"] == "hf://kvledger/tiny-sharded"
    assert doc["model"]["commit"] == hub.repos["kvledger/tiny-sharded"].refs["main"]
    local = kvledger(env, "plan", "--model", str(next(iter(
        hub.repos["kvledger/tiny-sharded"].commits.values()))), "--device", "cpu",
        "--max-model-len", "256", "--json")
    local_doc = json.loads(local.stdout)
    assert "uri" not in local_doc["model"]
    for key in ("classes", "kv", "fits", "required_bytes"):
        assert doc[key] == local_doc[key], key


def test_preflight_writes_the_plan_and_refuses_an_architecture_the_engine_cannot_run(
        hub, tmp_path) -> None:
    env = hub_env(hub.url, tmp_path)
    plan_out = tmp_path / "plan.json"
    result = kvledger(env, "preflight", "--model", "hf://kvledger/tiny-llama", "--device", "cpu",
                      "--max-model-len", "256", "--plan-out", str(plan_out),
                      "--termination-log", str(tmp_path / "log"))
    assert result.returncode == 0, result.stderr
    assert json.loads(plan_out.read_text())["model"]["uri"] == "hf://kvledger/tiny-llama"
    line = one_error_line(kvledger(env, "preflight", "--model", "hf://kvledger/gpt2-shaped",
                                   "--device", "cpu", "--termination-log", str(tmp_path / "l")))
    assert "unsupported architecture GPT2LMHeadModel" in line


def test_planning_a_hub_model_stays_torch_free(hub, tmp_path) -> None:
    """The init container plans hf:// models without torch or the server's aiohttp."""
    code = ("import sys; from kvledger.engine.cli import main; "
            "rc = main(['plan', '--model', 'hf://kvledger/tiny-llama', '--device-memory', '8GiB']); "
            "assert 'torch' not in sys.modules and 'aiohttp' not in sys.modules; sys.exit(rc)")
    result = subprocess.run([sys.executable, "-c", code], env=hub_env(hub.url, tmp_path),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_a_corrupt_header_names_the_model_not_a_temporary_folder(tmp_path) -> None:
    repo = tmp_path / "repo"
    write_checkpoint(repo, shards=1)
    shard = next(repo.glob("*.safetensors"))
    data = shard.read_bytes()
    shard.write_bytes(struct.pack("<Q", 10**12) + data[8:])
    with HubServer() as server:
        server.add_commit("kvledger/corrupt", repo)
        line = one_error_line(kvledger(hub_env(server.url, tmp_path), "plan", "--model",
                                       "hf://kvledger/corrupt", "--device-memory", "8GiB"))
    assert line.startswith("error: hf://kvledger/corrupt (commit ")
    assert "corrupt safetensors header" in line and "kvledger-hub-" not in line


@pytest.mark.parametrize("file", ["config.json", "model.safetensors.index.json"])
def test_json_nested_past_the_parser_is_one_line_exit_2(tmp_path, file) -> None:
    """A hub repository whose config.json or safetensors index is nested 100,000 deep:
    what parses it says so in one line, exit 2: plan both, fetch and the operator's
    download size the index (fetch downloads config.json as it is). The index is read
    member by member: its nesting is in a member."""
    repo = tmp_path / "repo"
    write_checkpoint(repo, shards=2)
    deep = "[" * 100_000 + "]" * 100_000
    (repo / file).write_text(deep if file == "config.json" else f'{{"metadata": {deep}}}')
    with HubServer() as server:
        server.add_commit("kvledger/deep", repo)
        env = hub_env(server.url, tmp_path)
        verbs = [["plan", "--model", "hf://kvledger/deep", "--device-memory", "8GiB"]]
        if file.endswith("index.json"):
            verbs.append(["fetch", "--model", "hf://kvledger/deep"])
        for argv in verbs:
            line = one_error_line(kvledger(env, *argv))
            assert "nested too deeply" in line, line
        if file.endswith("index.json"):
            with pytest.raises(BadInput, match="nested too deeply"):
                download_bytes("hf://kvledger/deep", endpoint=server.url)


# -- fetch --------------------------------------------------------------------------------


def test_fetch_downloads_what_the_engine_needs_once(hub, tmp_path) -> None:
    env = hub_env(hub.url, tmp_path)
    cache = tmp_path / "cache"
    hub.served.clear()
    first = kvledger(env, "fetch", "--model", "hf://kvledger/tiny-sharded", "--download-dir",
                     str(cache))
    assert first.returncode == 0, first.stderr
    commit = hub.repos["kvledger/tiny-sharded"].refs["main"]
    snapshot = cache / "models--kvledger--tiny-sharded" / "snapshots" / commit
    [line] = first.stdout.splitlines()
    assert line.startswith(f"fetched hf://kvledger/tiny-sharded (commit {commit}): "
                           "downloaded 4 files")
    assert line.endswith(f"0 already cached; snapshot {snapshot}")
    source = next(iter(hub.repos["kvledger/tiny-sharded"].commits.values()))
    expected = sorted(p.name for p in source.iterdir())
    assert sorted(p.name for p in snapshot.iterdir()) == expected
    weights = sum(p.stat().st_size for p in source.glob("*.safetensors"))
    assert hub.served_bytes("kvledger/tiny-sharded", ".safetensors") == weights
    every_file = sum(p.stat().st_size for p in source.iterdir())
    assert f"({every_file} bytes)" in line
    assert (cache / "models--kvledger--tiny-sharded" / "refs" / "main").read_text() == commit
    # Resolved once: every file was asked for at the commit, never at the moving branch.
    resolved = [path for _, path, _, _ in hub.requests
                if path.startswith("/kvledger/tiny-sharded/resolve/")]
    assert resolved and all(f"/resolve/{commit}/" in path for path in resolved)

    hub.served.clear()
    second = kvledger(env, "fetch", "--model", "hf://kvledger/tiny-sharded", "--download-dir",
                      str(cache))
    assert second.returncode == 0, second.stderr
    assert "downloaded 0 files, 0.0 GiB (0 bytes), 4 already cached" in second.stdout
    assert hub.served_bytes("kvledger/tiny-sharded") == 0


def test_download_bytes_is_what_fetch_downloads_without_reading_weights(
        hub, monkeypatch, tmp_path) -> None:
    point_hub_at(monkeypatch, hub.url, tmp_path)
    source = next(iter(hub.repos["kvledger/tiny-llama"].commits.values()))
    hub.served.clear()
    expected = sum(p.stat().st_size for p in source.iterdir())  # make-model writes only those
    assert download_bytes("hf://kvledger/tiny-llama", endpoint=hub.url) == expected
    assert hub.served_bytes("kvledger/tiny-llama") == 0
    big = hub.repos[BIG].commits[hub.repos[BIG].refs["main"]]
    index = json.loads((big / "model.safetensors.index.json").read_text())
    named = {"config.json", "model.safetensors.index.json", *index["weight_map"].values()}
    assert download_bytes(f"hf://{BIG}", endpoint=hub.url) == sum(
        (big / name).stat().st_size for name in named)
    assert hub.served_bytes(BIG, ".safetensors") == 0
    assert download_bytes("hf://kvledger/tiny-gated", token=TOKEN, endpoint=hub.url) == expected
    with pytest.raises(BadInput, match="no such model repository"):
        download_bytes("hf://kvledger/nope", endpoint=hub.url)
    with pytest.raises(BadInput, match="bad hub model"):
        download_bytes("hf://nope", endpoint=hub.url)


def test_gated_repo_needs_the_token(hub, tmp_path) -> None:
    cache = str(tmp_path / "cache")
    uri = "hf://kvledger/tiny-gated"
    no_token = hub_env(hub.url, tmp_path)
    for argv in (["fetch", "--model", uri, "--download-dir", cache],
                 ["plan", "--model", uri, "--device-memory", "8GiB"]):
        line = one_error_line(kvledger(no_token, *argv))
        assert line == (f"error: {uri} is gated: set HF_TOKEN to a token that has been granted "
                        "access (the hub answered 401)"), line
    hub.tokens.add("hf_no_access")
    wrong = one_error_line(kvledger(no_token | {"HF_TOKEN": "hf_no_access"}, "fetch", "--model",
                                    uri, "--download-dir", cache))
    assert wrong == (f"error: {uri} is gated and the token in HF_TOKEN has no access to it: "
                     "request access on the model's page (the hub answered 403)"), wrong
    bogus = one_error_line(kvledger(no_token | {"HF_TOKEN": "hf_bogus"}, "plan", "--model", uri,
                                    "--device-memory", "8GiB"))
    assert bogus == (f"error: {uri}: the hub at {hub.url} refused the token in HF_TOKEN (401: "
                     "invalid credentials)"), bogus
    right = no_token | {"HF_TOKEN": TOKEN}
    assert kvledger(right, "plan", "--model", uri, "--device-memory", "8GiB").returncode == 0
    fetched = kvledger(right, "fetch", "--model", uri, "--download-dir", cache)
    assert fetched.returncode == 0 and TOKEN not in fetched.stdout + fetched.stderr


@pytest.mark.parametrize(("uri", "message"), [
    ("hf://kvledger/nope", "error: hf://kvledger/nope: no such model repository at "),
    ("hf://kvledger/tiny-llama@v9", "error: hf://kvledger/tiny-llama@v9: kvledger/tiny-llama has "
                                    "no revision 'v9'"),
    ("hf://kvledger/no-safetensors", "has no model.safetensors or model.safetensors.index.json: "
                                     "kvledger loads only safetensors (found pytorch_model.bin)"),
])
def test_bad_models_are_one_line_exit_2(hub, tmp_path, uri, message) -> None:
    env = hub_env(hub.url, tmp_path)
    for argv in (["fetch", "--model", uri], ["plan", "--model", uri, "--device-memory", "8GiB"]):
        line = one_error_line(kvledger(env, *argv))
        assert message in line, line
    assert not (tmp_path / "hub").exists() or not any((tmp_path / "hub").rglob("*.safetensors"))


# `kvledger ARGV...` as a pod runs it, timed from inside: the clock starts once the
# interpreter is up and the hub client imported, so what it measures is the retry logic
# (each attempt, and the pauses hub_http takes between them, recorded), not how long this
# machine takes to start Python. Writes {"elapsed_s", "pauses_s"} to the file OUT.
_TIMED_KVLEDGER = """
import json, sys, time, types
import httpx2, huggingface_hub, huggingface_hub.hf_api
from kvledger.engine.checkpoint.hub import reads as hub_http
from kvledger.engine.cli import main

pauses = []
clock = types.ModuleType("time")
clock.__dict__.update(vars(time))
def sleep(seconds):
    pauses.append(seconds)
    time.sleep(seconds)
clock.sleep = sleep
hub_http.time = clock  # hub_http's pauses only
out, argv = sys.argv[1], sys.argv[2:]
started = time.monotonic()
try:
    rc = main(argv)
finally:
    with open(out, "w") as f:
        json.dump({"elapsed_s": time.monotonic() - started, "pauses_s": pauses}, f)
sys.exit(rc)
"""


def test_a_dead_endpoint_fails_after_bounded_retries(tmp_path) -> None:
    from kvledger.engine.checkpoint.hub.reads import TIMEOUT_S

    endpoint = closed_port_url()
    for argv in (["fetch", "--model", "hf://org/name"], ["plan", "--model", "hf://org/name"]):
        out = tmp_path / f"{argv[0]}-timed.json"
        result = subprocess.run([sys.executable, "-c", _TIMED_KVLEDGER, str(out), *argv],
                                env=hub_env(endpoint, tmp_path), capture_output=True, text=True,
                                timeout=120)
        line = one_error_line(result)
        assert line.startswith(f"error: hf://org/name: cannot reach the hub at {endpoint} after "
                               "4 attempts (ConnectError"), line
        timed = json.loads(out.read_text())
        # Bounded: 4 attempts, 3 pauses between them, doubling from 0.25 s.
        assert timed["pauses_s"] == [0.25, 0.5, 1.0], timed
        # Each attempt was refused at once: together they took less than one request's
        # timeout beyond the pauses (an attempt that waited its timeout out would not).
        assert timed["elapsed_s"] < sum(timed["pauses_s"]) + TIMEOUT_S, timed


def test_overloaded_hub_is_retried(hub, tmp_path) -> None:
    hub.fail_next(2)  # two 503s, then the answer
    result = kvledger(hub_env(hub.url, tmp_path), "plan", "--model", "hf://kvledger/tiny-llama",
                      "--device-memory", "8GiB")
    assert result.returncode == 0, result.stderr
    hub.fail_next(100)
    line = one_error_line(kvledger(hub_env(hub.url, tmp_path), "plan", "--model",
                                   "hf://kvledger/tiny-llama", "--device-memory", "8GiB"))
    hub.fail_next(0)
    assert "answered HTTP 503 after 4 attempts" in line


def test_fetch_refuses_a_local_directory(tmp_path) -> None:
    line = one_error_line(kvledger(hub_env(closed_port_url(), tmp_path), "fetch", "--model",
                                   str(tmp_path)))
    assert "--model must be hf://ORG/NAME[@REVISION]" in line


def test_offline_plan_uses_the_cache_or_says_to_fetch(hub, tmp_path) -> None:
    cache = str(tmp_path / "cache")
    env = hub_env(hub.url, tmp_path)
    offline = env | {"HF_HUB_OFFLINE": "1"}
    argv = ["plan", "--model", "hf://kvledger/tiny-llama", "--device-memory", "8GiB",
            "--download-dir", cache]
    line = one_error_line(kvledger(offline, *argv))
    assert "HF_HUB_OFFLINE=1 forbids downloading it: run `kvledger fetch --model " in line
    assert kvledger(env, "fetch", "--model", "hf://kvledger/tiny-llama", "--download-dir",
                    cache).returncode == 0
    hub.served.clear()
    assert kvledger(offline, *argv).returncode == 0
    assert hub.served_bytes("kvledger/tiny-llama") == 0


def test_a_redirect_to_another_host_does_not_carry_the_token() -> None:
    """The hub sends large files to a CDN on another host: the reads follow, and the token
    stays behind (huggingface_hub's session drops Authorization across origins)."""
    import http.server
    import threading

    from huggingface_hub.utils import build_hf_headers

    from kvledger.engine.checkpoint.hub.reads import Deadline, stream_get

    seen: list[tuple[str, str | None]] = []

    class Other(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            seen.append(("other host", self.headers.get("Authorization")))
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"ok")

        def log_message(self, *args):
            pass

    other = http.server.HTTPServer(("127.0.0.2", 0), Other)

    class Hub(Other):
        def do_GET(self):
            seen.append(("hub", self.headers.get("Authorization")))
            self.send_response(302)
            self.send_header("Location", f"http://127.0.0.2:{other.server_port}/blob")
            self.send_header("Content-Length", "0")
            self.end_headers()

    hub_host = http.server.HTTPServer(("127.0.0.1", 0), Hub)
    for server in (other, hub_host):
        threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        body = stream_get(f"http://127.0.0.1:{hub_host.server_port}/f",
                          build_hf_headers(token=TOKEN), 2, Deadline.after(10, "test"))
    finally:
        other.shutdown()
        hub_host.shutdown()
    assert body == b"ok"
    assert seen == [("hub", f"Bearer {TOKEN}"), ("other host", None)]


def test_a_bare_hub_id_is_a_hub_model_as_vllm_takes_it(hub, tmp_path, monkeypatch) -> None:
    """`vllm serve ORG/NAME`: plan, preflight and fetch take the bare id (an existing local
    path first, else the hub), the same path as hf://; the CRD refuses it naming hf://."""
    env = hub_env(hub.url, tmp_path)
    monkeypatch.chdir(tmp_path)  # no local folder of that name here
    bare = kvledger(env, "plan", "kvledger/tiny-sharded", "--device", "cpu",
                    "--max-model-len", "256", "--json")
    assert bare.returncode == 0, bare.stderr
    uri = kvledger(env, "plan", "--model", "hf://kvledger/tiny-sharded", "--device", "cpu",
                   "--max-model-len", "256", "--json")
    doc, uri_doc = json.loads(bare.stdout), json.loads(uri.stdout)
    assert doc["model"]["uri"] == "hf://kvledger/tiny-sharded"
    assert {k: doc[k] for k in ("classes", "kv", "fits")} == {k: uri_doc[k] for k in
                                                               ("classes", "kv", "fits")}
    fetched = kvledger(env, "fetch", "--model", "kvledger/tiny-sharded", "--download-dir",
                       str(tmp_path / "cache"))
    assert fetched.returncode == 0 and "fetched hf://kvledger/tiny-sharded" in fetched.stdout
    # An existing folder of that name is the local model, as in vLLM.
    local = tmp_path / "kvledger" / "tiny-sharded"
    local.parent.mkdir()
    local.symlink_to(next(iter(hub.repos["kvledger/tiny-sharded"].commits.values())))
    here = kvledger(env, "plan", "kvledger/tiny-sharded", "--device", "cpu",
                    "--max-model-len", "256", "--json")
    assert here.returncode == 0, here.stderr
    assert "uri" not in json.loads(here.stdout)["model"]
    # The served name is the id as launched (what a vLLM client sends as "model").
    config = config_from_args(argparse.Namespace(model_tag="Qwen/Qwen2.5-0.5B", model=None))
    assert (config.model, config.served_model_name) == ("hf://Qwen/Qwen2.5-0.5B",
                                                       "Qwen/Qwen2.5-0.5B")
    manifest = {"apiVersion": "kvledger.dev/v1alpha1", "kind": "InferenceService",
                "metadata": {"name": "bare"}, "spec": {"model": {"uri": "Qwen/Qwen2.5-0.5B"}}}
    with pytest.raises(BadInput, match="for the hub id ORG/NAME write hf://ORG/NAME"):
        validate_manifest(manifest)
