"""bench/tenants.py's pure parts and its workloads' (bench/tenants_workloads.py), without
any kvledger or vLLM server: the seeded workloads, the systems, the request bodies and
streams, the summaries, the claims and the options; and its client against a tiny
in-process stand-in (a 429, then a stream)."""

from __future__ import annotations

import contextlib
import itertools
import json
import sys
import time
from collections import Counter
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
try:
    import tenants
    import tenants_workloads as workloads
finally:
    sys.path.remove(str(ROOT / "bench"))

RAMP = workloads.RAMP_S


def test_flood_requests_are_seeded_per_client_and_in_range():
    first = list(itertools.islice(workloads.flood_requests(3, 1), 40))
    assert first == list(itertools.islice(workloads.flood_requests(3, 1), 40))
    assert first != list(itertools.islice(workloads.flood_requests(3, 2), 40))
    assert first != list(itertools.islice(workloads.flood_requests(4, 1), 40))
    many = list(itertools.islice(workloads.flood_requests(0, 0), 300))
    assert {cap for _, cap in many} == set(workloads.FLOOD_MAX_TOKENS)
    assert {len(p) for p, _ in many} <= set(range(64, 129))
    # every flood request fits the context (512) and, alone, the pool
    assert max(len(p) + cap for p, cap in many) <= 512
    assert all(len(workloads.SPECIAL_TOKENS) <= t < workloads.VOCAB_SIZE for p, _ in many for t in p)


def test_small_prompts_and_service_shapes():
    idle = workloads.idle_shapes(0, 5)
    assert idle == workloads.idle_shapes(0, 5)
    assert all(len(p) == 16 and cap == 16 for p, cap in idle)
    loaded = list(itertools.islice(workloads.small_prompts(0, "loaded"), 5))
    assert loaded != [p for p, _ in idle]          # idle and loaded prompts differ
    service = workloads.service_shapes(0, 3)
    assert all(len(p) == 96 and cap == 192 for p, cap in service)
    assert len({tuple(p) for p, _ in service}) == 3  # no prefix-cache help between them


def test_arrivals_are_seeded_gaps_of_one_to_three_seconds_within_the_window():
    offsets = workloads.arrival_offsets(0, 90)
    assert offsets == workloads.arrival_offsets(0, 90) != workloads.arrival_offsets(1, 90)
    assert offsets[0] == 0 and offsets[-1] < 90
    gaps = [b - a for a, b in itertools.pairwise(offsets)]
    assert all(1.0 <= g <= 3.0 for g in gaps)
    assert 30 <= len(offsets) <= 60
    assert workloads.arrival_offsets(0, 20) == [o for o in offsets if o < 20]
    slower = workloads.arrival_offsets(0, 90, period_s=6.0)
    assert all(3.0 <= b - a <= 9.0 for a, b in itertools.pairwise(slower))


def test_request_bodies():
    plain = tenants.body_of("m", [5, 6], 16, None, False)
    assert plain == {"model": "m", "prompt": [5, 6], "max_tokens": 16, "temperature": 0,
                     "ignore_eos": True}
    urgent = tenants.body_of("m", [5], 16, 0, True)
    assert urgent["priority"] == 0 and urgent["stream"] is True
    assert urgent["stream_options"] == {"include_usage": True}
    assert tenants.body_of("m", [5], 16, 10, False)["priority"] == 10


def test_stream_lines():
    assert tenants.parse_sse_line(b'data: {"choices": [{"text": "a"}]}\n') == {
        "choices": [{"text": "a"}]}
    assert tenants.parse_sse_line(b"data: [DONE]\n") is None
    assert tenants.parse_sse_line(b"\n") is None
    assert tenants.parse_sse_line(b": keep-alive\n") is None


def test_refusal_codes():
    body = json.dumps({"error": {"message": "x", "type": "t", "code": "tenant_queue_full"}})
    assert tenants.refusal_code(body) == "tenant_queue_full"
    assert tenants.refusal_code("Too Many Requests") == "none"
    assert tenants.refusal_code(json.dumps({"error": {"code": None}})) == "none"
    assert tenants.refusal_code(json.dumps([1])) == "none"


def _request(started, finished=None, result="completed", first=None, tokens=16, kind="light",
             attempts=1, codes=()):
    request = tenants.Request(16, 16, started, result, finished, tokens, attempts,
                              len(codes), kind=kind, first_token_s=first)
    request.refusals.update(codes)
    return request


def test_summary_of_small_requests():
    requests = [_request(0, 1, first=0.1), _request(2, 5, first=2.5, attempts=3,
                                                    codes=["kv_cache_full", "queue_full"]),
                _request(4, None, "past_deadline", codes=["kv_cache_full"]),
                _request(6, None, "server_error"), _request(8, None, "refused")]
    summary = tenants.summarize_small(requests, ttft=True)
    assert summary["sent"] == 5 and summary["completed"] == 2
    assert summary["p50_s"] == 1 and summary["p99_s"] == 3
    assert summary["ttft_p50_s"] == pytest.approx(0.1) and summary["ttft_p99_s"] == 0.5
    assert summary["rejected_429"] == 3
    assert summary["refusals"] == {"kv_cache_full": 2, "queue_full": 1}
    assert summary["attempts_max"] == 3
    assert (summary["past_deadline"], summary["server_errors_5xx"],
            summary["refused_other_4xx"]) == (1, 1, 1)
    assert "ttft_p99_s" not in tenants.summarize_small(requests)
    empty = tenants.summarize_small([], ttft=True)
    assert empty["p99_s"] is None and empty["ttft_p99_s"] is None and empty["completed"] == 0


def test_requests_in_flight_at_once():
    assert tenants.most_in_flight([]) == 0
    one_by_one = [_request(0, 1), _request(1, 2), _request(2, 3)]   # each ends as the next starts
    assert tenants.most_in_flight(one_by_one) == 1
    backlog = [_request(0, 10), _request(2, 12), _request(4, 5), _request(11, 13)]
    assert tenants.most_in_flight(backlog) == 3
    never_ends = [_request(0, None, "past_deadline"), _request(50, 51)]
    assert tenants.most_in_flight(never_ends) == 2


def test_goodput_counts_requests_completed_within_the_window_only():
    requests = [_request(0, RAMP - 0.1, tokens=100, kind="flood"),       # in the ramp
                _request(0, RAMP, tokens=128, kind="flood"),             # at the window's start
                _request(3, RAMP + 9.9, tokens=256, kind="flood"),
                _request(5, RAMP + 10, tokens=192, kind="flood"),        # at its end: out
                _request(6, None, "cancelled", tokens=0, kind="flood")]
    assert tenants.goodput(requests, 10) == (128 + 256) / 10
    assert tenants.goodput(requests, 10, rounds=2) == (128 + 256) / 20
    flood = tenants.summarize_flood(requests, 10, 1)
    assert flood["sent"] == 5 and flood["completed_in_window"] == 2
    assert flood["goodput_tok_s"] == (128 + 256) / 10


def test_service_time_and_the_light_bound():
    alone = [_request(0, 10, kind="service"), _request(10, 22, kind="service"),
             _request(22, 31, kind="service"), _request(31, None, "past_deadline")]
    assert tenants.service_time(alone) == 10
    assert tenants.service_time(alone[:2]) == 11        # the median of two: their mean
    assert tenants.service_time([]) is None
    assert tenants.light_bound(1.5, 10) == 13
    assert tenants.light_bound(None, 10) is None and tenants.light_bound(1.0, None) is None


def _server(preemptions=0.0, failed=0.0):
    return {"preemptions": preemptions, "recomputed_tokens": 0, "requests_failed": failed}


def _small(p99, ttft_p99=None, past=0, errors=0):
    return {"p99_s": p99, "ttft_p99_s": ttft_p99, "past_deadline": past,
            "server_errors_5xx": errors, "refused_other_4xx": 0}


def _two_tenants(arrival, fair, vllm, light_p99, idle_p99, service, kv_preempt, with_vllm):
    """Workload 1's or 3's figures, as claims() reads them."""
    out = {arrival: {"light": _small(60.0), "idle": _small(1.0), "service_s": None,
                     "server": _server(kv_preempt)},
           fair: {"light": _small(light_p99), "idle": _small(idle_p99), "service_s": service,
                  "server": _server()}}
    if with_vllm:
        out[vllm] = {"light": _small(50.0), "idle": _small(0.3), "service_s": 3.0,
                     "server": {"preemptions": 40.0, "recomputed_tokens": 9000}}
    return out


def _results(light_p99=12.0, idle_p99=1.0, service=10.0, ttft=(0.2, 0.2), good=(90.0, 100.0),
             kv_preempt=0.0, vllm=True, seats=(6.0, 0.5, 5.0)):
    """Workloads 1, 2 and 3 for claims(); ``seats``: workload 3's fair light p99, idle p99
    and service time."""
    one = _two_tenants(workloads.ARRIVAL, workloads.FAIR, workloads.VLLM, light_p99, idle_p99,
                       service, kv_preempt, vllm)
    three = _two_tenants(workloads.SEATS_ARRIVAL, workloads.SEATS_FAIR, workloads.SEATS_VLLM,
                         *seats, kv_preempt, vllm)
    two = {workloads.HEADROOM_SYS: {"urgent": _small(1.0, ttft[0]),
                                  "best_effort": {"goodput_tok_s": good[0]},
                                  "server": _server(kv_preempt)},
           workloads.NO_HEADROOM: {"urgent": _small(9.0, 8.0), "best_effort": {"goodput_tok_s": 1},
                                 "server": _server()}}
    if vllm:
        two[workloads.VLLM_PRIORITY] = {"urgent": _small(0.5, ttft[1]),
                                      "best_effort": {"goodput_tok_s": good[1]},
                                      "server": {"preemptions": 80.0}}
    return one, two, three


def _claim(claims, workload, words):
    return next(c for c in claims if c["claim"].startswith(workload) and words in c["claim"])


def test_claims_all_met():
    claims = tenants.claims(*_results())
    assert len(claims) == 10 and all(c["met"] for c in claims), claims
    assert _claim(claims, "workload 1", "light p99")["measured"] == (
        "12.00 s vs 2 x 1.00 s + 10.00 s = 12.00 s")
    # workload 3's bound: from its own server's idle p99 and service time
    assert _claim(claims, "workload 3", "light p99")["measured"] == (
        "6.00 s vs 2 x 0.50 s + 5.00 s = 6.00 s")
    assert [c["claim"].split(":")[0] for c in claims] == ["workload 1"] * 3 + [
        "workload 2"] * 4 + ["workload 3"] * 3


def test_the_light_bound_claim_fails_just_past_it():
    claims = tenants.claims(*_results(light_p99=12.01))
    assert [c["met"] for c in claims].count(False) == 1
    assert not _claim(claims, "workload 1", "light p99")["met"]


@pytest.mark.parametrize(("seats", "met"), [((6.0, 0.5, 5.0), True), ((6.01, 0.5, 5.0), False),
                                            ((2.0, 0.5, None), False), ((None, 0.5, 5.0), False)])
def test_the_seats_limited_light_bound_is_judged_on_its_own_server(seats, met):
    """Workload 3's claim: its fair server's light p99 against 2 x that server's idle p99
    + the service time measured on it; workload 1's figures do not enter."""
    claims = tenants.claims(*_results(seats=seats))
    assert _claim(claims, "workload 3", "light p99")["met"] is met
    assert [c["met"] for c in claims].count(False) == (not met)
    assert _claim(claims, "workload 1", "light p99")["met"]


@pytest.mark.parametrize(("ttft", "met"), [((0.22, 0.2), True), ((0.221, 0.2), False),
                                           ((0.1, 0.2), True), ((None, 0.2), False)])
def test_the_ttft_claim_allows_ten_percent(ttft, met):
    claim = next(c for c in tenants.claims(*_results(ttft=ttft)) if "TTFT" in c["claim"])
    assert claim["met"] is met


@pytest.mark.parametrize(("good", "met"), [((90.0, 100.0), True), ((89.9, 100.0), False),
                                           ((5.0, 0.0), True)])
def test_the_goodput_claim_is_nine_tenths_of_vllms(good, met):
    claim = next(c for c in tenants.claims(*_results(good=good)) if "goodput" in c["claim"])
    assert claim["met"] is met


def test_claims_that_fail():
    one, two, three = _results(kv_preempt=1.0)
    one[workloads.FAIR]["light"] = _small(None, past=2)
    two[workloads.HEADROOM_SYS]["urgent"] = _small(1.0, 0.2, errors=1)
    two[workloads.HEADROOM_SYS]["server"]["requests_failed"] = 1.0
    three[workloads.SEATS_FAIR]["server"]["blocks_reserved_idle"] = 2.0
    failed = [c["claim"] for c in tenants.claims(one, two, three) if not c["met"]]
    assert len(failed) == 7
    assert sum("preempts nothing" in c for c in failed) == 3
    assert sum("light request answered" in c for c in failed) == 2
    assert any("urgent request answered" in c for c in failed)


def test_a_block_left_reserved_once_idle_fails_the_kvledger_claim():
    one, two, three = _results()
    two[workloads.HEADROOM_SYS]["server"]["blocks_reserved_idle"] = 3.0
    failed = [c for c in tenants.claims(one, two, three) if not c["met"]]
    assert len(failed) == 1 and "every block back" in failed[0]["claim"]
    assert failed[0]["measured"].endswith("3 blocks reserved once idle")


def test_without_vllm_only_kvledgers_own_claims_are_judged():
    claims = tenants.claims(*_results(vllm=False))
    assert len(claims) == 8 and all(c["met"] for c in claims)
    assert not any("vLLM" in c["claim"] for c in claims)


def test_the_systems_and_their_flags():
    one, two, three = workloads.systems_of(vllm_found=True, plain_priority_too=True,
                                           pool_blocks=32, clients=24)
    assert [s.name for s in one] == [workloads.ARRIVAL, workloads.FAIR, workloads.VLLM]
    assert [s.name for s in two] == [workloads.HEADROOM_SYS, workloads.VLLM_PRIORITY,
                                     workloads.NO_HEADROOM]
    assert [s.name for s in three] == [workloads.SEATS_ARRIVAL, workloads.SEATS_FAIR,
                                       workloads.SEATS_VLLM]
    everyone = one + two + three
    assert len({s.name for s in everyone}) == len(everyone)   # one server each
    flags = {s.name: s.flags for s in everyone}
    assert "--no-tenant-fairness" in flags[workloads.ARRIVAL]
    assert "--no-tenant-fairness" not in flags[workloads.FAIR]
    # workload 3: workload 1's systems, the same flags and labels
    for seats, blocks in ((workloads.SEATS_ARRIVAL, workloads.ARRIVAL),
                          (workloads.SEATS_FAIR, workloads.FAIR),
                          (workloads.SEATS_VLLM, workloads.VLLM)):
        assert flags[seats] == flags[blocks]
        assert workloads.LABELS[seats] == workloads.LABELS[blocks]
    for name in (workloads.ARRIVAL, workloads.FAIR, workloads.HEADROOM_SYS, workloads.NO_HEADROOM,
                 workloads.SEATS_ARRIVAL, workloads.SEATS_FAIR):
        assert flags[name][:3] == ("--api-key", *workloads.KEYS.values())
    assert flags[workloads.HEADROOM_SYS][-4:] == ("--scheduling-policy", "priority",
                                                "--priority-headroom", "0.1")
    assert "--priority-headroom" not in flags[workloads.NO_HEADROOM]
    assert flags[workloads.VLLM] == () and flags[workloads.VLLM_PRIORITY] == (
        "--scheduling-policy", "priority")
    one, two, three = workloads.systems_of(vllm_found=False, plain_priority_too=False,
                                           pool_blocks=32, clients=24)
    assert [s.name for s in one + two + three] == [
        workloads.ARRIVAL, workloads.FAIR, workloads.HEADROOM_SYS, workloads.SEATS_ARRIVAL,
        workloads.SEATS_FAIR]
    # the service time is measured on each two-tenant workload's judged kvledger and vLLM
    assert {workloads.FAIR, workloads.VLLM, workloads.SEATS_FAIR,
            workloads.SEATS_VLLM} == workloads.SERVICE_TIMED


def test_each_system_has_its_pool_and_seats():
    """Workloads 1 and 2 on --pool-blocks and 32 seats; workload 3 on 8 seats and a pool
    that admits every flood client's largest request at once, kvledger and vLLM alike."""
    one, two, three = workloads.systems_of(vllm_found=True, plain_priority_too=True,
                                           pool_blocks=40, clients=24)
    assert {(s.pool_blocks, s.max_num_seqs) for s in one + two} == {(40, 32)}
    assert {(s.pool_blocks, s.max_num_seqs) for s in three} == {(24 * 12 + 16, 8)}
    _, _, quick = workloads.systems_of(vllm_found=True, plain_priority_too=False,
                                       pool_blocks=32, clients=12)
    assert {s.pool_blocks for s in quick} == {12 * 12 + 16}
    # the largest flood request (128-token prompt, max_tokens 256) takes 12 blocks of 32
    largest = max(len(p) + cap for p, cap in itertools.islice(workloads.flood_requests(0, 0), 300))
    assert -(-largest // 32) == workloads.LARGEST_FLOOD_BLOCKS == 12
    # so the flood at its largest fills the seats before the pool, with room for the light
    pool = workloads.seats_pool_blocks(24)
    assert pool - 24 * workloads.LARGEST_FLOOD_BLOCKS == workloads.SEATS_SPARE_BLOCKS > 0
    assert pool > workloads.SEATS * workloads.LARGEST_FLOOD_BLOCKS


def _pool_samples(engine, blocks):
    """The metric samples a server's pool is read from, as serving.scrape parses them."""
    if engine == "kvledger":
        return [("kvledger_kv_blocks_total", {}, float(blocks))]
    return [("vllm:cache_config_info", {"num_gpu_blocks": str(blocks), "block_size": "32"}, 1.0)]


def test_each_servers_pool_is_checked_against_its_own_system():
    one, _, three = workloads.systems_of(vllm_found=True, plain_priority_too=False,
                                         pool_blocks=32, clients=12)
    for system in one + three:
        tenants.check_pool(system, _pool_samples(system.engine, system.pool_blocks))
        other = 32 if system in three else 160     # the other workload's pool is refused
        with pytest.raises(tenants.BenchError, match=f"{system.name} runs {other}"):
            tenants.check_pool(system, _pool_samples(system.engine, other))
        with pytest.raises(tenants.BenchError, match="runs None KV blocks"):
            tenants.check_pool(system, [])


def test_options_quick_and_full():
    full = tenants.parse_args([])
    assert (full.rounds, full.window_seconds, full.clients, full.plain_priority_too) == (
        2, 90.0, 24, True)
    quick = tenants.parse_args(["--quick"])
    assert all(getattr(quick, k) == v for k, v in tenants.QUICK.items())
    mixed = tenants.parse_args(["--quick", "--clients", "5", "--plain-priority-too"])
    assert mixed.clients == 5 and mixed.plain_priority_too and mixed.rounds == 1
    assert full.pool_blocks == 32 and tenants.parse_args(["--pool-blocks", "64"]).pool_blocks == 64
    for bad in (["--rounds", "0"], ["--pool-blocks", "15"]):
        with pytest.raises(SystemExit):
            tenants.parse_args(bad)


@contextlib.asynccontextmanager
async def fake_completions(handler, port: int):
    """An aiohttp server on 127.0.0.1:``port`` answering /v1/completions with ``handler``."""
    app = web.Application()
    app.router.add_post("/v1/completions", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield
    finally:
        await runner.cleanup()


async def test_a_429_is_retried_after_its_wait_and_a_stream_timed_to_its_first_token(
        unused_tcp_port):
    calls = Counter()

    async def completions(request: web.Request) -> web.StreamResponse:
        calls[request.headers["Authorization"]] += 1
        if calls.total() == 1:
            return web.json_response({"error": {"code": "kv_cache_full"}}, status=429,
                                     headers={"Retry-After": "9", "retry-after-ms": "50"})
        response = web.StreamResponse()
        await response.prepare(request)
        for text in ("a", "b"):
            chunk = {"choices": [{"index": 0, "text": text}]}
            await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        usage = {"choices": [], "usage": {"completion_tokens": 2}}
        await response.write(b"data: " + json.dumps(usage).encode() + b"\n\ndata: [DONE]\n\n")
        return response

    async with fake_completions(completions, unused_tcp_port):
        start = time.monotonic()
        request = tenants.Request(16, 16, 0.0, kind="urgent")
        async with tenants.session_for("key-b") as session:
            await tenants.send(session, f"http://127.0.0.1:{unused_tcp_port}",
                               tenants.body_of("m", [5], 16, 0, True), request, start, 30)
    assert calls == {"Bearer key-b": 2}
    assert request.result == "completed" and request.output_tokens == 2
    assert (request.attempts, request.rejected_429) == (2, 1)
    assert request.refusals == {"kv_cache_full": 1}
    assert 0.05 <= request.first_token_s <= request.finished_s < 5   # retry-after-ms, not 9 s


async def test_a_stream_that_ends_in_an_error_event_is_a_server_error(unused_tcp_port):
    async def completions(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        await response.write(b'data: {"error": {"code": "engine_dead"}}\n\n')
        return response

    async with fake_completions(completions, unused_tcp_port):
        request = tenants.Request(16, 16, 0.0, kind="urgent")
        async with aiohttp.ClientSession() as session:
            await tenants.send(session, f"http://127.0.0.1:{unused_tcp_port}",
                               tenants.body_of("m", [5], 16, 0, True), request,
                               time.monotonic(), 30)
    assert request.result == "server_error" and request.attempts == 1


def _system_figures(number, engine, busy=0.0, done=True, kv_wait=0.0):
    small = [_request(RAMP, RAMP + 1, first=RAMP + 0.1), _request(RAMP + 2, RAMP + 4,
                                                                   first=RAMP + 2.2)]
    if not done:
        small = [_request(RAMP, None, "past_deadline")]
    flood = [_request(0, RAMP + 3, tokens=192, kind="flood")]
    server = ({"preemptions": 0.0, "recomputed_tokens": 0, "requests_failed": 0.0,
               "kv_wait_s": kv_wait}
              if engine == "kvledger" else
              {"preemptions": 5.0, "recomputed_tokens": 700, "tokens_fed": 9000,
               "requests_failed": 0.0})
    ttft = number == 2
    figures = {"idle": tenants.summarize_small(small, ttft),
               "urgent" if ttft else "light": tenants.summarize_small(small, ttft),
               "best_effort" if ttft else "flood": tenants.summarize_flood(flood, 10, 1),
               "rounds": [{"small": tenants.summarize_small(small, ttft),
                           "small_in_flight_max": tenants.most_in_flight(small),
                           "flood_goodput_tok_s": tenants.goodput(flood, 10),
                           "other_cpu_cores": busy}],
               "server": server}
    if number != 2:
        figures |= {"service_s": tenants.service_time(small), "service_n": len(small)}
    return figures


@pytest.mark.parametrize("vllm", [True, False])
def test_tables_render(vllm):
    one_systems, two_systems, three_systems = workloads.systems_of(
        vllm, plain_priority_too=True, pool_blocks=32, clients=4)
    one = {s.name: _system_figures(1, s.engine, kv_wait=812.25) for s in one_systems}
    two = {s.name: _system_figures(2, s.engine, busy=0.5 if s.engine == "vllm" else None,
                                   done=s.name != workloads.NO_HEADROOM) for s in two_systems}
    three = {s.name: _system_figures(3, s.engine, kv_wait=0.004) for s in three_systems}
    report = {"config": {"device": "cpu", "rounds": 1, "window_seconds": 10.0, "clients": 4,
                         "period_seconds": 2.0, "pool_blocks": 32, "seats_max_num_seqs": 8,
                         "seats_pool_blocks": workloads.seats_pool_blocks(4)},
              "vllm_found": vllm, "vllm_missing": None if vllm else "no vllm on PATH",
              "workload1": one, "workload2": two, "workload3": three,
              "claims": tenants.claims(one, two, three)}
    text = tenants.tables(report)
    first, _, third = text.partition("Workload 3,")
    line = "| light under the flood: p50 / p99 | 1.00 s / 2.00 s |"
    assert line in first and line in third
    assert "--max-num-seqs 32, 32 KV blocks of 32" in first
    assert third.startswith(" two tenants where the seats run out first: workload 1 on "
                            "--max-num-seqs 8 and 64 KV blocks of 32")
    kv_wait = "| time waited for KV blocks, all requests, s (kvledger_queue_wait_seconds_sum) |"
    assert f"{kv_wait} 812.2 | 812.2 |" in first and f"{kv_wait} 0.0 | 0.0 |" in third
    assert (f"{kv_wait} 0.0 | 0.0 | - |" in third) is vllm
    assert ("kvledger priority, no headroom" in text) and ("vLLM priority" in text) is vllm
    assert ("Note: other processes took up to 0.50 cores" in text) is vllm
    assert ("vLLM not found (no vllm on PATH)" in text) is not vllm
    assert text.count("\nmet   ") + text.count("\nFAILED") == len(report["claims"])
    json.dumps(report)  # --json prints it
