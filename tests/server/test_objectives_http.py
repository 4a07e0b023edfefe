"""A gateway's InferenceObjective header over HTTP (``server/objectives.py``): the test
client's 127.0.0.1 is the trusted gateway. An objective's priority orders the line as the
request's own would (higher is more urgent, as the InferenceObjective says), only from the
gateway, only under the priority policy, never past a tenants file's floor; the file is
read again when it changes, and a bad one never drops the objectives held."""

from __future__ import annotations

import asyncio

import pytest
from _server_helpers import make_llm, model_name, start_app, wait_for_metric
from multidict import CIMultiDict

from kvledger.engine.cli import main
from kvledger.engine.errors import BadInput
from kvledger.engine.frontend.submission import Tenant
from kvledger.engine.server.objectives import Objectives, parse_objectives
from kvledger.engine.server.tenants import Tenants, read_tenants_file

OBJECTIVE = "x-gateway-inference-objective"
FAIRNESS = "x-gateway-inference-fairness-id"
OBJECTIVES = """
objectives:
  - name: critical
    priority: 10
  - name: sheddable
    priority: -10
  - name: plain
"""


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    # 16 blocks of 16: each request below (8 + 150 tokens, 10 blocks) runs alone
    return make_llm(tiny_llama_dir, num_gpu_blocks_override=16, scheduling_policy="priority")


async def _client(aiohttp_client, llm, tmp_path, trusted="127.0.0.1/32", **options):
    path = tmp_path / "objectives.yaml"
    path.write_text(OBJECTIVES)
    return await start_app(aiohttp_client, llm, tenant_header=FAIRNESS,
                           tenant_header_from=(trusted,), objective_header=OBJECTIVE,
                           objectives_file=str(path), tenant_fairness=False, **options)


async def _send(client, finished, name, headers=(), **body):
    response = await client.post("/v1/completions", headers=CIMultiDict(list(headers)), json={
        "model": model_name(client), "prompt": "Once upon a time", "max_tokens": 150,
        "ignore_eos": True, "temperature": 0, **body})
    finished.append(name)
    return response.status, await response.json()


async def _flood_then_one(client, headers, **body):
    """Five plain requests (a0 runs, four wait), then ``b`` with ``headers``: the order
    they finish in."""
    finished: list[str] = []
    flood = [asyncio.create_task(_send(client, finished, f"a{i}")) for i in range(5)]
    await wait_for_metric(client, "kvledger_requests_waiting", 4)
    other = asyncio.create_task(_send(client, finished, "b", headers, **body))
    await wait_for_metric(client, "kvledger_requests_waiting", 5)
    results = await asyncio.gather(*flood, other)
    assert all(status == 200 for status, _ in results), results
    return finished


async def test_a_critical_objective_goes_first(aiohttp_client, llm, tmp_path):
    """Before, the header meant nothing to the engine: b, last in, finished last."""
    client = await _client(aiohttp_client, llm, tmp_path)
    finished = await _flood_then_one(client, [(OBJECTIVE, "critical")])
    assert finished.index("b") == 1  # the next to start once a0 ends


async def test_a_sheddable_objective_waits_for_the_plain_ones(aiohttp_client, llm, tmp_path):
    client = await _client(aiohttp_client, llm, tmp_path)
    finished: list[str] = []
    first = asyncio.create_task(_send(client, finished, "a0"))
    await wait_for_metric(client, "kvledger_requests_running", 1)
    shed = asyncio.create_task(_send(client, finished, "shed", [(OBJECTIVE, "sheddable")]))
    await wait_for_metric(client, "kvledger_requests_waiting", 1)
    rest = [asyncio.create_task(_send(client, finished, f"a{i}")) for i in (1, 2)]
    await wait_for_metric(client, "kvledger_requests_waiting", 3)
    await asyncio.gather(first, shed, *rest)
    assert finished[-1] == "shed", finished


async def test_the_body_priority_is_the_clients_own_ask(aiohttp_client, llm, tmp_path):
    """The body's priority wins over the objective's (a sheddable objective asked -1)."""
    client = await _client(aiohttp_client, llm, tmp_path)
    finished = await _flood_then_one(client, [(OBJECTIVE, "sheddable")], priority=-1)
    assert finished.index("b") == 1


@pytest.mark.parametrize("headers", [
    [(OBJECTIVE, "unknown")],                         # no such objective: priority 0
    [(OBJECTIVE, "plain")],                           # unset is 0, as the router reads it
])
async def test_an_objective_at_zero_or_unknown_waits_its_turn(aiohttp_client, llm, tmp_path,
                                                               headers):
    client = await _client(aiohttp_client, llm, tmp_path)
    finished = await _flood_then_one(client, headers)
    assert finished[-1] == "b"


async def test_an_untrusted_peers_objective_is_ignored(aiohttp_client, llm, tmp_path):
    client = await _client(aiohttp_client, llm, tmp_path, trusted="10.0.0.0/8")
    finished = await _flood_then_one(client, [(OBJECTIVE, "critical")])
    assert finished[-1] == "b"


async def test_an_objective_given_twice_is_a_400_naming_it(aiohttp_client, llm, tmp_path):
    client = await _client(aiohttp_client, llm, tmp_path)
    for headers in ([(OBJECTIVE, "critical"), (OBJECTIVE, "plain")],
                    [(OBJECTIVE, "plain, critical")]):
        status, body = await _send(client, [], "x", headers, max_tokens=1)
        assert status == 400, body
        assert body["error"]["message"] == (
            f"{OBJECTIVE} is given more than once: a request names one objective (the gateway "
            f"must replace a client's {OBJECTIVE}, not add to it)")


async def test_under_fcfs_an_objective_is_not_used_and_not_refused(aiohttp_client,
                                                                    tiny_llama_dir, tmp_path):
    llm = make_llm(tiny_llama_dir, num_gpu_blocks_override=16)
    client = await _client(aiohttp_client, llm, tmp_path)
    finished = await _flood_then_one(client, [(OBJECTIVE, "critical")])
    assert finished[-1] == "b"


def _objectives(tmp_path, tenants_text=None, text=OBJECTIVES):
    specs = ()
    if tenants_text is not None:
        (tmp_path / "tenants.yaml").write_text(tenants_text)
        specs = read_tenants_file(tmp_path / "tenants.yaml")
    tenants = Tenants((), specs, max_queue_len=8, header=FAIRNESS, header_from=("10.0.0.0/8",))
    path = tmp_path / "objectives.yaml"
    path.write_text(text)
    objectives = Objectives(OBJECTIVE, str(path), tenants)
    objectives.reload()
    return tenants, objectives, path


def test_a_tenants_files_floor_holds_an_objective(tmp_path):
    """An objective any client may name is never a way around a tier: held to the floor,
    not refused (the gateway chose it); without a file there is no tier to guard."""
    tenants, objectives, _ = _objectives(tmp_path, "tenants:\n  - name: silver\n"
                                                   "    priority: 10\n    minPriority: 5\n")
    silver = tenants.of(None, {FAIRNESS: "silver"}, "10.0.0.1")
    stranger = tenants.of(None, {FAIRNESS: "x"}, "10.0.0.1")
    for tenant in (silver, stranger):
        assert objectives.priority({OBJECTIVE: "critical"}, "10.0.0.1", tenant) == 5
        assert objectives.priority({OBJECTIVE: "sheddable"}, "10.0.0.1", tenant) == 10
    _, untiered, _ = _objectives(tmp_path / "..", None)
    assert untiered.priority({OBJECTIVE: "critical"}, "10.0.0.1", Tenant("k", "other", 1.0,
                                                                         None, 0, 0)) == -10


def test_the_file_is_read_again_and_a_bad_one_keeps_what_was_held(tmp_path, caplog):
    _, objectives, path = _objectives(tmp_path)
    assert objectives.priorities == {"critical": 10, "sheddable": -10, "plain": 0}
    assert objectives.reload() is False  # unchanged
    path.write_text("objectives:\n  - name: critical\n    priority: 3\n")
    assert objectives.reload() is True and objectives.priorities == {"critical": 3}
    for bad in ("objectives: [", "objectives:\n  - name: a\n    priority: x\n",
                "objectives:\n  - name: a\n  - name: a\n", b"\xff\xfe"):
        path.write_bytes(bad if isinstance(bad, bytes) else bad.encode())
        assert objectives.reload() is False
        assert objectives.priorities == {"critical": 3}
    assert "the objectives stay as they were" in caplog.text
    path.unlink()  # the ConfigMap not mounted (yet): none
    assert objectives.reload() is True and objectives.priorities == {}


@pytest.mark.parametrize(("text", "message"), [
    ("tenants: []", "expected 'objectives:' and a list"),
    ("objectives: {a: 1}", "expected 'objectives:' and a list"),
    ("objectives:\n  - name: a\n    weight: 1\n", "objective 0: expected a mapping"),
    ("objectives:\n  - priority: 1\n", "objective 0: name must be"),
    (f"objectives:\n  - name: a\n    priority: {2**31}\n", "priority must be a 32-bit"),
    ("objectives:\n  - name: a\n    priority: true\n", "priority must be a 32-bit"),
])
def test_a_bad_file_is_refused_naming_the_entry(text, message):
    with pytest.raises(BadInput, match=message):
        parse_objectives(text, "f")
    assert parse_objectives("", "f") == {}


@pytest.mark.parametrize("flags", [
    ["--objective-header", OBJECTIVE],
    ["--objectives-file", "/x.yaml"],
    ["--objective-header", OBJECTIVE, "--objectives-file", "/x.yaml"],  # no tenant header
])
def test_the_objective_flags_need_each_other_and_the_gateways_addresses(tiny_llama_dir,
                                                                        capsys, flags):
    code = main(["serve", "--model", str(tiny_llama_dir), "--device", "cpu", "--port", "0",
                 *flags])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith("error: --objective-header")
