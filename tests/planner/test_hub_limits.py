"""A hostile or broken hub cannot hang or flood the planner: every hf:// read ends within a
deadline per file and one per command (``--hub-timeout``), a redirect loop is one error
line, and a small file is read no further than the size the listing gives it.

Against tests/hub_server.py's misbehaviours (``drip_s``, ``redirect_loops``,
``listed_sizes``); each test serves its own repo, so they do not disturb each other."""

from __future__ import annotations

import time

import pytest
from _hub_helpers import hub_env, kvledger, one_error_line, point_hub_at
from hub_server import LISTING, HubServer

from kvledger.engine.checkpoint.hub import reads as hub_http
from kvledger.engine.checkpoint.hub.headers import header_mirror
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
