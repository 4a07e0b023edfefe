"""Tenants as configured (``server/tenants.py``): the file's names, keys, weights, places
in line and priorities; a gateway's header believed only from trusted peers; per-tenant
metrics under bounded labels, never a key."""

from __future__ import annotations

import asyncio

import pytest
from _server_helpers import make_llm, metric, model_name, start_app, wait_for_metric

from kvledger.engine.errors import BadInput
from kvledger.engine.server.tenants import OTHER, Tenants, TenantSpec, read_tenants_file

FILE = """
tenants:
  - name: team-a
    keys: [sk-a1, sk-a2]
    weight: 2
    maxQueued: 3
  - name: batch
    keys: [sk-batch]
    priority: 10
    minPriority: 5
"""


def _tenants(tmp_path, **options):
    path = tmp_path / "tenants.yaml"
    path.write_text(FILE)
    return Tenants(("sk-plain",), read_tenants_file(path), max_queue_len=256, **options)


def test_keys_map_to_their_tenant_and_unlisted_keys_to_their_own(tmp_path):
    tenants = _tenants(tmp_path)
    assert tenants.keys == ("sk-plain", "sk-a1", "sk-a2", "sk-batch")
    plain, a1, a2, batch = (tenants.of(i, {}, "10.0.0.1") for i in range(4))
    assert (plain.label, a1.label, a2.label, batch.label) == ("key-0", "team-a", "team-a", "batch")
    assert a1 == a2 and a1.weight == 2.0 and a1.max_queued == 3
    assert plain.max_queued == 128 and batch.max_queued == 128  # half the line: several keys
    assert tenants.of(None, {}, None).label == "anonymous"
    assert tenants.labels == ["anonymous", "key-0", "team-a", "batch"]
    assert all("sk-" not in label for label in tenants.labels)


def test_priorities_default_and_floor(tmp_path):
    tenants = _tenants(tmp_path)
    batch, team = tenants.of(3, {}, None), tenants.of(1, {}, None)
    assert batch.priority_for(None) == 10 and batch.priority_for(7) == 7
    with pytest.raises(BadInput, match="more urgent than tenant batch may ask"):
        batch.priority_for(0)
    with pytest.raises(BadInput, match="at least 0"):  # its floor is its default, 0
        team.priority_for(-1)
    assert tenants.of(0, {}, None).priority_for(-100) == -100  # a plain key: no floor


def test_a_header_names_the_tenant_only_from_a_trusted_peer(tmp_path):
    tenants = _tenants(tmp_path, header="X-Kvledger-Tenant", header_from=("10.1.0.0/16",))
    named = {"x-kvledger-tenant": "batch"}
    assert tenants.of(0, named, "10.1.2.3").label == "batch"
    assert tenants.of(0, named, "10.2.0.1").label == "key-0"   # untrusted: its key decides
    assert tenants.of(None, named, "not-an-ip").label == "anonymous"
    stranger = tenants.of(None, {"x-kvledger-tenant": "someone"}, "10.1.0.9")
    assert stranger.label == OTHER and stranger.key == "header:someone"
    assert OTHER in tenants.labels
    with pytest.raises(BadInput, match="longer than"):
        tenants.of(None, {"x-kvledger-tenant": "x" * 200}, "10.1.0.9")
    with pytest.raises(BadInput, match="needs --tenant-header-from"):
        Tenants((), (), max_queue_len=8, header="x-kvledger-tenant")


@pytest.mark.parametrize("text, message", [
    ("tenants: []", "a list of tenants"),
    ("tenants:\n  - name: Team A\n", "name must be"),
    ("tenants:\n  - name: other\n", "name must be"),
    ("tenants:\n  - name: a\n    wieght: 2\n", "unknown field 'wieght'"),
    ("tenants:\n  - name: a\n    weight: 0\n", "weight must be"),
    ("tenants:\n  - name: a\n    keys: sk-1\n", "keys must be a list"),
    ("tenants:\n  - name: a\n    maxQueued: -1\n", "maxQueued must be an integer >= 0"),
    ("tenants:\n  - name: a\n    priority: 1\n    minPriority: 3\n", "minPriority 3 is above"),
    ("tenants: [\n", "cannot read it"),
])
def test_a_bad_file_is_one_clear_error(tmp_path, text, message):
    path = tmp_path / "tenants.yaml"
    path.write_text(text)
    with pytest.raises(BadInput, match=message):
        read_tenants_file(path)


def test_two_tenants_may_not_share_a_key_or_a_name():
    with pytest.raises(BadInput, match="also"):
        Tenants((), (TenantSpec("a", ("k",)), TenantSpec("b", ("k",))), max_queue_len=8)
    with pytest.raises(BadInput, match="share a name"):
        Tenants((), (TenantSpec("a",), TenantSpec("a",)), max_queue_len=8)


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return make_llm(tiny_llama_dir, num_gpu_blocks_override=16, scheduling_policy="priority")


async def _send(client, key, **body):
    response = await client.post("/v1/completions", headers={"Authorization": f"Bearer {key}"},
                                 json={"model": model_name(client), "prompt": "Once upon a time",
                                       "max_tokens": 150, "ignore_eos": True, **body})
    return response.status, await response.json()


async def test_the_files_keys_open_the_api_and_are_counted_per_tenant(aiohttp_client, llm,
                                                                       tmp_path):
    path = tmp_path / "tenants.yaml"
    path.write_text(FILE)
    client = await start_app(aiohttp_client, llm, tenants=read_tenants_file(path))
    assert (await _send(client, "sk-unknown", max_tokens=1))[0] == 401
    assert (await _send(client, "sk-a2", max_tokens=2))[0] == 200
    status, body = await _send(client, "sk-batch", max_tokens=1, priority=0)
    assert status == 400 and body["error"]["param"] == "priority"
    flood = [asyncio.create_task(_send(client, "sk-a1")) for _ in range(4)]  # one runs
    await wait_for_metric(client, "kvledger_requests_waiting", 3)
    assert await metric(client, "kvledger_tenant_requests_waiting", 'tenant="team-a"') == 3
    status, body = await _send(client, "sk-a1")  # its three places in line are taken
    assert status == 429 and body["error"]["code"] == "tenant_queue_full"
    assert all(status == 200 for status, _ in await asyncio.gather(*flood))
    assert await metric(client, "kvledger_tenant_requests_admitted_total",
                        'tenant="team-a"') == 5
    assert await metric(client, "kvledger_tenant_requests_rejected_total",
                        'reason="tenant_queue_full",tenant="team-a"') >= 1
    assert await metric(client, "kvledger_tenant_generation_tokens_total",
                        'tenant="team-a"') == 2 + 4 * 150
    text = await (await client.get("/metrics")).text()
    assert "sk-a1" not in text and 'tenant="batch"' in text  # labels, never keys


async def test_a_header_from_an_untrusted_peer_names_no_tenant(aiohttp_client, llm):
    """An attacker sends the gateway's header straight to the server: ignored (its key
    decides); from the trusted peer (here the test client's 127.0.0.1) it names the tenant."""
    async def waiting_as(options, headers):
        client = await start_app(aiohttp_client, llm, api_keys=("k",),
                                 tenant_header="x-kvledger-tenant", **options)
        hold = asyncio.create_task(_send(client, "k"))  # runs
        await wait_for_metric(client, "kvledger_requests_running", 1)
        queued = asyncio.create_task(client.post("/v1/completions", headers={
            "Authorization": "Bearer k", **headers}, json={
            "model": model_name(client), "prompt": "x", "max_tokens": 150, "ignore_eos": True}))
        await wait_for_metric(client, "kvledger_requests_waiting", 1)
        text = await (await client.get("/metrics")).text()
        await asyncio.gather(hold, queued)
        # Its server and engine thread stop here: the next server steps the same engine,
        # and two threads stepping it would wake each other's line, not their own.
        await client.close()
        return [line for line in text.splitlines()
                if line.startswith("kvledger_tenant_requests_waiting{") and line.endswith(" 1.0")]

    spoofed = await waiting_as({"tenant_header_from": ("10.0.0.0/8",)},
                               {"x-kvledger-tenant": "someone"})
    assert spoofed == ['kvledger_tenant_requests_waiting{tenant="key-0"} 1.0']
    trusted = await waiting_as({"tenant_header_from": ("127.0.0.1/32",)},
                               {"x-kvledger-tenant": "someone"})
    assert trusted == ['kvledger_tenant_requests_waiting{tenant="other"} 1.0']
