"""--pipeline-parallel-size in the engine (issue 44): one process per stage (gloo on the CPU),
each loading only its stage's tensors and keeping its own layers' KV, the hidden states
sent stage to stage, the logits from the last stage to rank 0, where the one scheduler,
ledger and admission run. Greedy tokens and prompt logprobs equal one process's for
several architectures; a stage that dies fails the engine at once, over HTTP too."""

from __future__ import annotations

import dataclasses
import time

import pytest
from _server_helpers import reap, serve_then_kill_a_rank

from kvledger.engine.errors import BadInput
from kvledger.engine.llm import LLM
from kvledger.engine.planner.plan import make_plan
from kvledger.engine.sampling.params import SamplingParams

PROMPTS = [[1, 5, 9, 33, 7, 21, 2], [2, 3, 4], list(range(10, 60))]
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
SCORED = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=2)


def _run(model_dir, pp: int, params: SamplingParams, **flags):
    llm = LLM(str(model_dir), device="cpu", dtype="float32", max_model_len=128,
              pipeline_parallel_size=pp, **flags)
    try:
        return llm.generate(PROMPTS, params), llm
    finally:
        ranks = getattr(llm.engine.runner, "ranks", None)
        if ranks is not None:
            ranks.stop()


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("name", "stages"), [("tiny-llama", 2), ("tiny-qwen2", 3),
                                              ("tiny-mixtral", 2)])
def test_greedy_tokens_across_stages_equal_one_process(make_model_dir, name, stages) -> None:
    model_dir = make_model_dir(name)
    one, _ = _run(model_dir, 1, GREEDY)
    staged, llm = _run(model_dir, stages, GREEDY)
    assert [o.outputs[0].token_ids for o in staged] == [o.outputs[0].token_ids for o in one]
    plan = llm.engine.plan
    assert plan.pipeline_parallel_size == stages
    # rank 0 holds stage 1's layers alone, and their KV in a pool of the plan's blocks
    first = plan.stages[0]
    # the plan the engine runs under is re-planned with what every stage's rank measured
    assert "weights" in plan.measured
    predicted = make_plan(dataclasses.replace(llm.engine.config, device="cpu"))
    assert [f.classes["weights"] for f in plan.stages] == [
        f.classes["weights"] for f in predicted.stages]
    assert len(llm.engine.runner.model.model.layers) == first.end_layer - first.first_layer
    assert llm.engine.runner.kv_cache.shape[0] == first.end_layer - first.first_layer
    assert llm.engine.runner.kv_cache.shape[3] == plan.kv.num_blocks


@pytest.mark.timeout(300)
def test_prompt_logprobs_come_back_from_the_last_stage(make_model_dir) -> None:
    model_dir = make_model_dir("small-llama")
    one, _ = _run(model_dir, 1, SCORED)
    staged, _ = _run(model_dir, 4, SCORED)
    for a, b in zip(one, staged, strict=True):
        assert len(a.prompt_logprobs) == len(b.prompt_logprobs) == len(a.prompt_token_ids)
        assert a.prompt_logprobs[0] is None and b.prompt_logprobs[0] is None
        for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:], strict=True):
            assert (x.token_id, x.rank) == (y.token_id, y.rank)
            assert x.logprob == pytest.approx(y.logprob, abs=1e-4)
            assert [t for t, _ in x.top] == [t for t, _ in y.top]


@pytest.mark.timeout(300)
def test_prompt_logits_under_logprobs_mode_come_back_from_the_last_stage(make_model_dir) -> None:
    """--logprobs-mode raw_logits reaches the last stage's process (its RankSpec): the
    prompt's values are logits there as in one process, not log-probabilities."""
    model_dir = make_model_dir("tiny-llama")
    one, _ = _run(model_dir, 1, SCORED, logprobs_mode="raw_logits")
    staged, _ = _run(model_dir, 2, SCORED, logprobs_mode="raw_logits")
    logprobs, _ = _run(model_dir, 1, SCORED)
    for a, b, c in zip(one, staged, logprobs, strict=True):
        for x, y, z in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:], c.prompt_logprobs[1:],
                           strict=True):
            assert x.logprob == pytest.approx(y.logprob, abs=1e-4)
            assert x.logprob != pytest.approx(z.logprob, abs=1e-3)  # not log_softmax's


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2"])
def test_two_stages_of_two_ranks_each_equal_one_process(make_model_dir, name) -> None:
    """pp = 2 x tp = 2: four processes, each stage's two ranks sharded and all-reducing in
    their own group, the hidden states sent rank to rank (the tied Qwen2 head on the last
    stage sharded from the embedding it loads)."""
    model_dir = make_model_dir(name)
    one, _ = _run(model_dir, 1, GREEDY)
    staged, llm = _run(model_dir, 2, GREEDY, tensor_parallel_size=2)
    assert [o.outputs[0].token_ids for o in staged] == [o.outputs[0].token_ids for o in one]
    assert len(llm.engine.runner.ranks.processes) == 3
    whole = llm.engine.plan.shape
    assert llm.engine.runner.config.num_attention_heads == whole.num_attention_heads // 2


def test_lora_across_stages_is_refused_by_name(tiny_llama_dir) -> None:
    with pytest.raises(BadInput, match="LoRA adapters across pipeline stages"):
        LLM(str(tiny_llama_dir), device="cpu", pipeline_parallel_size=2, enable_lora=True)


@pytest.mark.timeout(180)
def test_a_stage_that_dies_fails_the_engine_promptly(tiny_llama_dir) -> None:
    proc, _, killed = serve_then_kill_a_rank(tiny_llama_dir, "-pp", "2")
    try:
        while proc.poll() is None and time.monotonic() - killed < 30:
            time.sleep(0.1)
        assert proc.returncode not in (None, 0)
        assert time.monotonic() - killed < 10
        assert "rank 1 of 2 exited" in proc.stderr.read()
    finally:
        reap(proc)


def test_a_step_cut_into_micro_batches_comes_back_in_the_batch_order() -> None:
    """A step of many tokens is cut into parts (each a run of its prefill chunks and a run
    of its decodes, of about equal tokens, at least MIN_PART_TOKENS), a small step is one
    part; the parts' logits rows (completed prompts first, then decodes, each part's) merge
    back in ``ScheduledBatch.sampled``'s order, and the fresh blocks go with the first."""
    import torch

    from kvledger.engine.core.runner import StepOutput
    from kvledger.engine.core.scheduler import PrefillChunk, ScheduledBatch
    from kvledger.engine.core.stage_runner import MIN_PART_TOKENS, merge_outputs, micro_batches

    class Seq:
        def __init__(self, rid: int, prompt: int) -> None:
            self.request_id, self.num_prompt_tokens = rid, prompt

    decodes = [Seq(i, 5) for i in range(10, 16)]
    assert len(micro_batches(ScheduledBatch([], decodes), 4)) == 1  # 6 tokens: one part
    prefills = [PrefillChunk(Seq(0, 300), 0, 300), PrefillChunk(Seq(1, 90), 0, 30),
                PrefillChunk(Seq(2, 200), 0, 200), PrefillChunk(Seq(3, 212), 80, 132)]
    batch = ScheduledBatch(prefills, decodes, [7, 8])
    parts = micro_batches(batch, 3)
    assert len(parts) == 3 and parts[0].fresh_blocks == [7, 8]
    assert all(p.fresh_blocks == [] for p in parts[1:])
    assert [c for p in parts for c in p.prefills] == prefills
    assert [s for p in parts for s in p.decodes] == decodes
    sizes = [sum(c.length for c in p.prefills) + len(p.decodes) for p in parts]
    assert sum(sizes) == 668 and min(sizes) >= MIN_PART_TOKENS

    def output(part):  # each sampled row holds its sequence's id
        ids = [s.request_id for s in part.sampled]
        return StepOutput(torch.tensor(ids, dtype=torch.float32)[:, None], {})

    merged = merge_outputs(parts, [output(p) for p in parts])
    assert merged.logits[:, 0].tolist() == [s.request_id for s in batch.sampled]
    assert [s.request_id for s in batch.sampled] == [0, 2, 3, *range(10, 16)]


@pytest.mark.timeout(300)
def test_stopping_the_ranks_gives_this_process_its_threads_back(tiny_llama_dir) -> None:
    """Rank 0 runs on a share of the cores while its ranks live; once they stop, a later
    engine in the same process has every thread again."""
    import torch

    before = torch.get_num_threads()
    _run(tiny_llama_dir, 2, SamplingParams(max_tokens=2, temperature=0))
    assert torch.get_num_threads() == before
