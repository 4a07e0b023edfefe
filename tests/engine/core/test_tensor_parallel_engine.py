"""--tensor-parallel-size 2 in the engine (issue 23): one process per rank (gloo on the
CPU), each rank its shard and its own KV pool of its heads, one scheduler and ledger in
rank 0. Greedy tokens equal one rank's for every architecture the engine serves (fp32);
a rank that dies fails the engine at once (/health 503, exit non-zero), never a hang."""

from __future__ import annotations

import time
import urllib.error
import urllib.request

import pytest
from _server_helpers import reap, serve_then_kill_a_rank

from kvledger.engine.errors import BadInput
from kvledger.engine.llm import LLM
from kvledger.engine.model.builtin import MODELS
from kvledger.engine.sampling.params import SamplingParams

PROMPTS = [[1, 5, 9, 33, 7, 21, 2], [2, 3, 4], list(range(10, 60))]
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
ARCHITECTURES = sorted({MODELS[name]["architectures"][0]: name for name in MODELS
                        if name.startswith("tiny-")}.items())


def _greedy(model_dir, tp: int) -> tuple[list[list[int]], object]:
    llm = LLM(str(model_dir), device="cpu", dtype="float32", max_model_len=128,
              tensor_parallel_size=tp)
    try:
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)], llm
    finally:
        ranks = getattr(llm.engine.runner, "ranks", None)
        if ranks is not None:
            ranks.stop()


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("architecture", "name"), ARCHITECTURES,
                         ids=[a for a, _ in ARCHITECTURES])
def test_greedy_tokens_at_tp_2_equal_one_rank(make_model_dir, architecture, name) -> None:
    model_dir = make_model_dir(name)
    one, _ = _greedy(model_dir, 1)
    two, llm = _greedy(model_dir, 2)
    assert two == one
    config = llm.engine.runner.config  # rank 0's shard: its heads, its KV pool
    whole = llm.engine.plan.shape
    assert config.num_attention_heads == whole.num_attention_heads // 2
    assert config.num_kv_heads == max(1, whole.num_kv_heads // 2)
    assert llm.engine.runner.kv_cache.shape[2] == config.num_kv_heads
    assert llm.engine.plan.tensor_parallel_size == 2


def test_a_model_the_engine_cannot_split_is_refused_by_name(tiny_llama_dir) -> None:
    """tiny-llama has 4 heads: 3 ranks cannot share them (the planner refuses first)."""
    with pytest.raises(BadInput, match="--tensor-parallel-size 3: LlamaForCausalLM has 4 "
                                       "attention heads"):
        LLM(str(tiny_llama_dir), device="cpu", tensor_parallel_size=3)


def _health(port: int) -> int | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return None


@pytest.mark.timeout(180)
def test_a_rank_that_dies_fails_the_engine_promptly(tiny_llama_dir) -> None:
    proc, port, killed = serve_then_kill_a_rank(tiny_llama_dir, "-tp", "2")
    try:
        statuses = []
        while proc.poll() is None and time.monotonic() - killed < 30:
            statuses.append(_health(port))
            time.sleep(0.1)
        assert proc.poll() is not None, "serve did not exit after its rank died"
        assert proc.returncode != 0
        assert 503 in statuses  # a probe saw the engine dead before it went
        assert time.monotonic() - killed < 10
        assert "rank 1 of 2 exited" in proc.stderr.read()
    finally:
        reap(proc)
