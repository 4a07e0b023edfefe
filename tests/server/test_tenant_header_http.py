"""A gateway's tenant header over HTTP, as a client behind the gateway would bend it (the
test client's 127.0.0.1 is the trusted gateway): the header given twice, or as a list, is
a 400 naming it; a case variant of a listed name is that tenant, floor included; a name the
file does not list is held to the least urgent tier the file gives; and no file tenant may
take the name the server gives an --api-key key."""

from __future__ import annotations

import pytest
from _server_helpers import make_llm, metric, model_name, start_app
from multidict import CIMultiDict

from kvledger.engine.cli import main
from kvledger.engine.errors import BadInput
from kvledger.engine.server.tenants import Tenants, read_tenants_file

HEADER = "x-kvledger-tenant"
FILE = """
tenants:
  - name: gold
    keys: [sk-gold]
  - name: silver
    keys: [sk-silver]
    priority: 10
    minPriority: 10
"""


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return make_llm(tiny_llama_dir, num_gpu_blocks_override=16, scheduling_policy="priority")


@pytest.fixture
async def client(aiohttp_client, llm, tmp_path):
    path = tmp_path / "tenants.yaml"
    path.write_text(FILE)
    return await start_app(aiohttp_client, llm, api_keys=("sk-plain",),
                           tenants=read_tenants_file(path), tenant_header=HEADER,
                           tenant_header_from=("127.0.0.1/32",))


async def _send(client, headers: list[tuple[str, str]], **body):
    response = await client.post(
        "/v1/completions", headers=CIMultiDict([("Authorization", "Bearer sk-silver"),
                                                *headers]),
        json={"model": model_name(client), "prompt": "Once upon a time", "max_tokens": 2,
              **body})
    return response.status, await response.json()


async def _admitted(client, tenant: str) -> float:
    return await metric(client, "kvledger_tenant_requests_admitted_total",
                        f'tenant="{tenant}"')


async def test_a_second_tenant_header_is_a_400_naming_it(client):
    """The gateway's gold, then the client's silver: before, the first won and the request
    ran as gold at priority 0. Now neither: 400, nothing admitted."""
    for headers in ([(HEADER, "gold"), (HEADER, "silver")], [(HEADER, "silver"), (HEADER, "gold")],
                    [(HEADER, "gold, silver")]):
        status, body = await _send(client, headers, priority=0)
        assert status == 400, (headers, body)
        assert body["error"]["message"].startswith(f"{HEADER} is given more than once")
        assert body["error"]["type"] == "invalid_request_error"
    assert await _admitted(client, "gold") == await _admitted(client, "silver") == 0
    status, _ = await _send(client, [(HEADER, "silver")], priority=10)
    assert status == 200 and await _admitted(client, "silver") == 1


async def test_a_case_variant_is_the_tenant_it_spells_floor_included(client):
    status, body = await _send(client, [(HEADER, "SILVER")], priority=-1000)
    assert status == 400 and body["error"]["param"] == "priority"
    assert "more urgent than tenant silver may ask (at least 10)" in body["error"]["message"]
    status, _ = await _send(client, [(HEADER, "Silver")])
    assert status == 200 and await _admitted(client, "silver") == 1


async def test_a_name_the_file_does_not_list_gets_the_least_urgent_tier(client):
    status, body = await _send(client, [(HEADER, "stranger")], priority=-1000)
    assert status == 400 and body["error"]["param"] == "priority"
    assert body["error"]["message"] == ("priority -1000 is more urgent than a tenant "
                                        "--tenants-file does not list may ask (at least 10)")
    for asked in (None, 10):
        status, _ = await _send(client, [(HEADER, "stranger")],
                                **({} if asked is None else {"priority": asked}))
        assert status == 200
    assert await _admitted(client, "other") == 2


async def test_an_untrusted_peers_headers_name_no_tenant_however_many(aiohttp_client, llm,
                                                                     tmp_path):
    path = tmp_path / "tenants.yaml"
    path.write_text(FILE)
    client = await start_app(aiohttp_client, llm, tenants=read_tenants_file(path),
                             tenant_header=HEADER, tenant_header_from=("10.0.0.0/8",))
    status, _ = await _send(client, [(HEADER, "gold"), (HEADER, "silver")], priority=10)
    assert status == 200 and await _admitted(client, "silver") == 1  # its key decides


@pytest.mark.parametrize(("text", "default", "floor"), [
    ("tenants:\n  - name: a\n", 0, 0),
    ("tenants:\n  - name: a\n    priority: -5\n", 0, 0),
    ("tenants:\n  - name: a\n  - name: b\n    priority: 100\n    minPriority: 5\n", 100, 5),
])
def test_the_least_urgent_tier_follows_the_file(tmp_path, text, default, floor):
    """An unlisted name runs by default at the largest priority any tenant has, and may ask
    no more urgent than the largest minPriority: 0 for both at the least."""
    path = tmp_path / "tenants.yaml"
    path.write_text(text)
    tenants = Tenants((), read_tenants_file(path), max_queue_len=8, header=HEADER,
                      header_from=("10.0.0.0/8",))
    stranger = tenants.of(None, {HEADER: "x"}, "10.0.0.1")
    assert stranger.priority_for(None) == default
    assert stranger.priority_for(floor) == floor
    with pytest.raises(BadInput, match=f"at least {floor}"):
        stranger.priority_for(floor - 1)


@pytest.mark.parametrize("name", ["key-0", "key-12"])
def test_a_file_tenant_named_as_an_api_key_is_refused_at_start(tiny_llama_dir, tmp_path,
                                                               capsys, name):
    """Before, a file tenant key-0 took --api-key's first key's priority floor and metrics."""
    path = tmp_path / "tenants.yaml"
    path.write_text(FILE + f"  - name: {name}\n    keys: [sk-file]\n    minPriority: 50\n"
                           f"    priority: 50\n")
    code = main(["serve", "--model", str(tiny_llama_dir), "--device", "cpu", "--port", "0",
                 "--api-key", "sk-plain", "--tenants-file", str(path)])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"error: --tenants-file {path}: tenant 2: name must be")
    assert f"got '{name}'" in err


async def test_leaving_the_header_out_is_no_way_around_a_floor(aiohttp_client, llm, tmp_path):
    """Tenants named by the gateway's header alone (no keys): a request that carries no
    header (a client whose gateway route lets it through without one) is anonymous. Before,
    anonymous had no floor: priority -1000 ran ahead of every tier. Now it is held to the
    least urgent tier the file gives, as a name the file does not list is."""
    path = tmp_path / "tenants.yaml"
    path.write_text("tenants:\n  - name: gold\n  - name: silver\n    priority: 10\n"
                    "    minPriority: 10\n")
    client = await start_app(aiohttp_client, llm, tenants=read_tenants_file(path),
                             tenant_header=HEADER, tenant_header_from=("127.0.0.1/32",))

    async def send(**body):
        response = await client.post("/v1/completions", json={
            "model": model_name(client), "prompt": "Once upon a time", "max_tokens": 2, **body})
        return response.status, await response.json()

    status, body = await send(priority=-1000)
    assert status == 400 and body["error"]["param"] == "priority"
    assert "more urgent than tenant anonymous may ask (at least 10)" in body["error"]["message"]
    assert (await send(priority=10))[0] == 200 and (await send())[0] == 200
    without_file = Tenants((), (), max_queue_len=8, header=HEADER, header_from=("10.0.0.0/8",))
    assert without_file.of(None, {}, "10.0.0.1").priority_for(-1000) == -1000  # no tiers
