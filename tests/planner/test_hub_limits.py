"""A hostile or broken hub cannot hang or flood the planner: every hf:// read ends within a
deadline per file and one per command (``--hub-timeout``), a redirect loop is one error
line, a small file is read no further than the size the listing gives it, and what one
model's read may take (``read_limits``: its bytes, shards and tensors) is refused, naming
the limit, before it is read, in a bounded amount of memory.

Against tests/hub_server.py's misbehaviours (``drip_s``, ``redirect_loops``,
``listed_sizes``) and tests/hostile_hub.py's repos; each test serves its own repo, so they
do not disturb each other. ``kvledger plan`` runs as the pod's pre-flight does, in its own
process, whose peak memory ``os.wait4`` reports."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import threading
import time

import pytest
from _hub_helpers import hub_env, kvledger, one_error_line, point_hub_at, run_with_peak
from hostile_hub import CONFIG, shard_name, tiny_tensors, write_heavy_repo, write_shard
from hub_server import LISTING, HubServer

from kvledger.engine.checkpoint.hub import reads as hub_http
from kvledger.engine.checkpoint.hub.headers import header_mirror, remove_open_mirrors
from kvledger.engine.checkpoint.hub.repo import download_bytes
from kvledger.engine.errors import BadInput


@pytest.fixture
def hub(tmp_path, make_model_dir):
    with HubServer() as server:
        server.add_commit("kvledger/tiny-llama", make_model_dir("tiny-llama"))
        yield server


def test_a_dripping_file_ends_at_the_command_deadline(hub, tmp_path, monkeypatch):
    hub.drip_s["config.json"] = 0.5  # a byte every 0.5 s: minutes for the whole file
    point_hub_at(monkeypatch, hub.url, tmp_path)
    started = time.monotonic()
    with pytest.raises(BadInput) as caught, header_mirror("hf://kvledger/tiny-llama",
                                                          timeout_s=2.0):
        pass
    elapsed = time.monotonic() - started
    assert "reading config.json from the hub" in str(caught.value)
    assert "took longer than --hub-timeout 2 s" in str(caught.value)
    # Checked as each byte arrives: at most one drip interval (and a read timeout's
    # granularity) past the deadline, never the file's minutes.
    assert 2.0 <= elapsed < 2.0 + 3.0, elapsed


def test_each_file_has_its_own_deadline_within_the_commands(hub, tmp_path, monkeypatch):
    hub.drip_s["config.json"] = 0.3
    point_hub_at(monkeypatch, hub.url, tmp_path)
    monkeypatch.setattr(hub_http, "FILE_TIMEOUT_S", 1.0)
    with pytest.raises(BadInput, match=r"config\.json .*took longer than the 1 s per file"), \
            header_mirror("hf://kvledger/tiny-llama", timeout_s=60.0):
        pass


def test_a_mirror_open_when_the_process_ends_is_removed_and_not_made_again(
        hub, tmp_path, monkeypatch):
    """The operator's sizing threads are daemons: at SIGTERM the process ends inside a
    ``with header_mirror`` whose ``finally`` never runs. ``remove_open_mirrors`` (atexit,
    and before serve's os._exit) removes the folder, and the header reads still under way
    fail instead of making it again (each stayed, 13 MiB for a wide model, 450 of them
    after a day of runs)."""
    point_hub_at(monkeypatch, hub.url, tmp_path)
    hub.drip_s["config.json"] = 0.005  # its read is under way at the exit (~2 s)
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    monkeypatch.setattr(tempfile, "tempdir", None)
    (tmp_path / "tmp").mkdir()
    failed: list[BaseException] = []

    def size() -> None:
        try:
            with header_mirror("hf://kvledger/tiny-llama", timeout_s=30.0):
                pass
        except BaseException as exc:  # what the read under way ends with
            failed.append(exc)

    thread = threading.Thread(target=size, daemon=True)
    thread.start()
    while not hub.served_bytes("kvledger/tiny-llama", "config.json"):
        time.sleep(0.01)
    (mirror,) = (tmp_path / "tmp").iterdir()
    remove_open_mirrors()
    assert not mirror.exists()
    thread.join(30)
    assert not thread.is_alive()
    assert isinstance(failed[0], FileNotFoundError), failed  # config.json had no folder
    assert not list((tmp_path / "tmp").iterdir())


def test_plan_with_a_stalled_hub_is_one_error_line(hub, tmp_path):
    hub.drip_s["config.json"] = 1.0
    result = kvledger(hub_env(hub.url, tmp_path), "plan", "--model", "hf://kvledger/tiny-llama",
                      "--device-memory", "8GiB", "--hub-timeout", "1.5")
    line = one_error_line(result)
    assert "took longer than --hub-timeout 1.5 s" in line, line


def test_a_dripping_listing_ends_at_the_deadline(hub, tmp_path, monkeypatch):
    """The operator sizes a pod's cache from the listing on a thread of its own process: a
    stalled listing must not hold that thread for hours."""
    hub.drip_s[LISTING] = 0.5
    point_hub_at(monkeypatch, hub.url, tmp_path)
    started = time.monotonic()
    with pytest.raises(BadInput, match=r"reading the file listing .*took longer than "
                                       r"--hub-timeout 2 s"):
        download_bytes("hf://kvledger/tiny-llama", timeout_s=2.0)
    assert time.monotonic() - started < 2.0 + 3.0


def test_a_redirect_loop_is_one_error_line(hub, tmp_path):
    hub.redirect_loops.add("config.json")
    result = kvledger(hub_env(hub.url, tmp_path), "plan", "--model", "hf://kvledger/tiny-llama",
                      "--device-memory", "8GiB")
    line = one_error_line(result)
    assert "redirected too many times for config.json" in line, line


def test_a_small_file_is_read_no_further_than_its_listed_size(tmp_path, make_model_dir,
                                                              monkeypatch):
    folder = tmp_path / "model"
    folder.mkdir()
    for path in make_model_dir("tiny-llama").iterdir():
        (folder / path.name).write_bytes(path.read_bytes())
    config = folder / "config.json"
    config.write_bytes(config.read_bytes() + b" " * (48 * 2**20))  # valid JSON, 48 MiB
    with HubServer() as hub:
        hub.add_commit("kvledger/liar", folder)
        hub.listed_sizes["config.json"] = 200
        point_hub_at(monkeypatch, hub.url, tmp_path)
        with pytest.raises(BadInput, match="sent more than the 200 bytes its listing gives"), \
                header_mirror("hf://kvledger/liar"):
            pass
        # The client stopped after 201 bytes; what the server got out before it noticed is
        # socket buffers, not the 48 MiB it would have read without the cap.
        assert hub.served_bytes("kvledger/liar", "config.json") < 16 * 2**20


# What `kvledger plan` of a tiny hub model peaks at (imports included) is ~40 MiB; these
# reads may add no more than their records.
PLAN_PEAK_MIB = 120


def plan_peak(hub: HubServer, tmp_path, repo: str) -> tuple[subprocess.CompletedProcess, float]:
    """``kvledger plan`` of ``hf://repo`` (its own process), and its peak memory in MiB."""
    return run_with_peak([sys.executable, "-m", "kvledger.engine.cli", "plan", "--model",
                          f"hf://{repo}", "--device-memory", "80GiB"], hub_env(hub.url, tmp_path))


def test_headers_past_what_one_read_may_take_are_refused_before_they_are_read(tmp_path):
    """6 shards of 20 MB headers: the first are asked for, the one past 64 MiB is refused
    at its length prefix and the others stop where they are."""
    repo = write_heavy_repo(tmp_path / "heavy", shards=6, header_bytes=20_000_000)
    with HubServer() as hub:
        hub.add_commit("hostile/heavy", repo)
        result, peak = plan_peak(hub, tmp_path, "hostile/heavy")
        line = one_error_line(result)
        assert line.startswith("error: hf://hostile/heavy (commit ")
        assert ("its config.json, index and safetensors headers come to more than 64 MiB, "
                "the most kvledger reads of one model") in line
        assert hub.served_bytes("hostile/heavy") <= 64 * 2**20
    assert peak < PLAN_PEAK_MIB, peak


def test_an_index_of_too_many_shards_is_refused_before_any_is_read(tmp_path):
    repo = tmp_path / "many"
    repo.mkdir()
    (repo / "config.json").write_text(json.dumps(CONFIG))
    shards = 1100
    for k in range(shards):
        write_shard(repo / shard_name(k, shards), tiny_tensors([f"t{k}"]), 1)
    (repo / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {f"t{k}": shard_name(k, shards) for k in range(shards)}}))
    with HubServer() as hub:
        hub.add_commit("hostile/many", repo)
        line = one_error_line(kvledger(hub_env(hub.url, tmp_path), "plan", "--model",
                                       "hf://hostile/many", "--device-memory", "8GiB"))
        assert "its index names 1100 shards, more than the 1024 kvledger reads" in line
        assert not [r for r in hub.requests if r[1].endswith(".safetensors")]


def test_headers_of_too_many_tensors_are_refused_as_they_are_counted(tmp_path):
    """300,000 one-byte tensors in 16 MB of headers: within the bytes, past the tensors;
    the read stops at the limit, so its records cost what 262,144 of them do at most."""
    repo = tmp_path / "crowd"
    repo.mkdir()
    (repo / "config.json").write_text(json.dumps(CONFIG))
    names = [f"t{i}" for i in range(300_000)]
    write_shard(repo / "model.safetensors", tiny_tensors(names), len(names))
    with HubServer() as hub:
        hub.add_commit("hostile/crowd", repo)
        result, peak = plan_peak(hub, tmp_path, "hostile/crowd")
    line = one_error_line(result)
    assert "it declares more than 262,144 tensors, the most kvledger reads of one model" in line
    assert peak < PLAN_PEAK_MIB + 80, peak


def test_a_header_entry_of_many_megabytes_is_refused_without_parsing_it_whole(tmp_path):
    """A __metadata__ of 2 million one-letter pairs (12 MB): json.loads would build
    hundreds of MiB of it; one entry may be 1 MiB."""
    repo = tmp_path / "meta"
    repo.mkdir()
    (repo / "config.json").write_text(json.dumps(CONFIG))
    pairs = ",".join(f'"{i}":"v"' for i in range(2_000_000))
    header = ('{"__metadata__":{' + pairs + '},"t":{"dtype":"U8","shape":[1],'
              '"data_offsets":[0,1]}}').encode()
    write_shard(repo / "model.safetensors", header + b" " * (-len(header) % 8), 1)
    with HubServer() as hub:
        hub.add_commit("hostile/meta", repo)
        result, peak = plan_peak(hub, tmp_path, "hostile/meta")
    line = one_error_line(result)
    assert "corrupt safetensors header: not valid JSON (a member is over 1 MiB)" in line
    assert peak < PLAN_PEAK_MIB, peak
