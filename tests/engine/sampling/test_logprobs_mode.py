"""vLLM's ``--logprobs-mode``, checked against transformers' logits on the same weights:
``raw_logits`` reports the model's logits, ``processed_logprobs`` / ``processed_logits``
what the token was drawn from (bias and the other processors, then temperature, top_k and
top_p with what they leave out at -inf), and prompt tokens are raw in every mode."""

from __future__ import annotations

import math

import pytest
import torch
import transformers
from _engine_helpers import drain, make_engine

from kvledger.engine import LLM
from kvledger.engine.cli import main
from kvledger.engine.sampling.params import SamplingParams

PROMPT = [17, 300, 42, 901, 77, 5, 640, 12, 250, 99]
TOP = 6  # the top entries read: more than top_k, so the ones it leaves out are seen


@pytest.fixture(scope="module")
def hf_logits(tiny_llama_dir):
    """Teacher-forced transformers logits ``[len(ids), vocab]``."""
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    model.eval()

    def logits(ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return model(torch.tensor([ids])).logits[0].float()

    return logits


def _run(tiny_llama_dir, mode: str, params: SamplingParams):
    engine = make_engine(tiny_llama_dir, logprobs_mode=mode)
    engine.add_request("q", PROMPT, params)
    return drain(engine)["q"]


def _check(out, expected_rows: list[torch.Tensor]) -> None:
    """Each output token's value and top entries are its expected row's."""
    assert len(out.logprobs) == len(out.token_ids) == len(expected_rows)
    for token_id, entry, row in zip(out.token_ids, out.logprobs, expected_rows, strict=True):
        assert entry.token_id == token_id
        want = row[token_id].item()
        assert entry.logprob == pytest.approx(want, abs=1e-4)
        values, ids = row.topk(len(entry.top))
        for (got_id, got), want_id, want_value in zip(entry.top, ids.tolist(), values.tolist(),
                                                      strict=True):
            if math.isinf(want_value):
                assert got == want_value  # left out by top_k/top_p: -inf, as vLLM's
            else:
                assert got_id == want_id and got == pytest.approx(want_value, abs=1e-4)
        assert entry.rank == int((row > row[token_id]).sum()) + 1


def test_raw_logits_are_the_models_logits_for_output_and_prompt(tiny_llama_dir, hf_logits):
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=TOP,
                            prompt_logprobs=2)
    out = _run(tiny_llama_dir, "raw_logits", params)
    reference = hf_logits(PROMPT + out.token_ids)
    _check(out, [reference[len(PROMPT) - 1 + j] for j in range(5)])
    assert out.prompt_logprobs[0] is None
    for position, entry in enumerate(out.prompt_logprobs[1:], start=1):
        assert entry.logprob == pytest.approx(reference[position - 1, PROMPT[position]].item(),
                                              abs=1e-4)


@pytest.mark.parametrize("mode", ["processed_logprobs", "processed_logits"])
def test_processed_values_are_those_the_token_was_drawn_from(tiny_llama_dir, hf_logits, mode):
    """Temperature 0.7, top_k 4 and a bias: the reported row is the biased logits over
    0.7 with all but the top 4 at -inf (its log_softmax for processed_logprobs), and the
    sampled token is always one of those 4. The prompt's stay raw."""
    bias = {300: 3.0}
    params = SamplingParams(temperature=0.7, top_k=4, seed=5, max_tokens=6, ignore_eos=True,
                            logit_bias=bias, logprobs=TOP, prompt_logprobs=1)
    out = _run(tiny_llama_dir, mode, params)
    reference = hf_logits(PROMPT + out.token_ids)
    rows = []
    for j in range(6):
        row = reference[len(PROMPT) - 1 + j].clone()
        row[300] += 3.0
        row = row / 0.7
        row = row.masked_fill(row < row.topk(4).values[-1], float("-inf"))
        rows.append(torch.log_softmax(row, -1) if mode == "processed_logprobs" else row)
    _check(out, rows)
    raw = torch.log_softmax(reference, -1)
    if mode == "processed_logprobs":
        assert out.prompt_logprobs[3].logprob == pytest.approx(raw[2, PROMPT[3]].item(),
                                                               abs=1e-4)


def test_processed_top_p_leaves_the_rest_at_minus_infinity(tiny_llama_dir, hf_logits):
    params = SamplingParams(temperature=1.0, top_p=0.05, seed=1, max_tokens=3,
                            ignore_eos=True, logprobs=TOP)
    out = _run(tiny_llama_dir, "processed_logprobs", params)
    reference = hf_logits(PROMPT + out.token_ids)
    for j, entry in enumerate(out.logprobs):
        probs = torch.softmax(reference[len(PROMPT) - 1 + j], -1)
        ordered = probs.sort(descending=True).values
        kept = int(((ordered.cumsum(0) - ordered) < 0.05).sum())
        finite = [value for _, value in entry.top if value > float("-inf")]
        assert len(finite) == min(kept, TOP)
        assert entry.logprob > float("-inf")  # the token drawn was one that was kept


def test_a_greedy_row_beside_a_sampled_one_reports_its_processed_logits(tiny_llama_dir,
                                                                        hf_logits):
    """In one batch, a greedy row's processed values are its biased logits (no temperature,
    as vLLM's), whatever the sampled row beside it does."""
    engine = make_engine(tiny_llama_dir, logprobs_mode="processed_logits")
    engine.add_request("g", PROMPT, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True,
                                                   logit_bias={42: -2.0}, logprobs=TOP))
    engine.add_request("s", PROMPT, SamplingParams(temperature=0.5, seed=2, max_tokens=3,
                                                   ignore_eos=True, logprobs=TOP))
    out = drain(engine)["g"]
    reference = hf_logits(PROMPT + out.token_ids)
    rows = []
    for j in range(3):
        row = reference[len(PROMPT) - 1 + j].clone()
        row[42] -= 2.0
        rows.append(row)
    _check(out, rows)


def test_the_default_mode_is_raw_logprobs_whatever_the_sampling(tiny_llama_dir, hf_logits):
    params = SamplingParams(temperature=0.7, top_k=4, seed=5, max_tokens=3, ignore_eos=True,
                            logit_bias={300: 3.0}, logprobs=TOP)
    out = _run(tiny_llama_dir, "raw_logprobs", params)
    reference = torch.log_softmax(hf_logits(PROMPT + out.token_ids), -1)
    _check(out, [reference[len(PROMPT) - 1 + j] for j in range(3)])


def test_the_mode_from_the_python_api_and_the_command_line(tiny_llama_dir, hf_logits, capsys):
    llm = LLM(str(tiny_llama_dir), device="cpu", max_model_len=64, logprobs_mode="raw_logits")
    [out] = llm.generate([{"prompt_token_ids": PROMPT}],
                         SamplingParams(temperature=0, max_tokens=1, logprobs=1), use_tqdm=False)
    [entry] = out.outputs[0].logprobs
    assert entry.logprob == pytest.approx(hf_logits(PROMPT)[-1].max().item(), abs=1e-4)
    assert main(["plan", str(tiny_llama_dir), "--device", "cpu",
                 "--logprobs-mode", "processed_logprobs"]) == 0
    capsys.readouterr()
    assert main(["plan", str(tiny_llama_dir), "--device", "cpu",
                 "--logprobs-mode", "processed"]) == 2
    assert "--logprobs-mode" in capsys.readouterr().err


@pytest.mark.parametrize("mode", ["raw_logprobs", "raw_logits"])
def test_a_constrained_rows_raw_values_are_under_its_grammars_mask(tiny_llama_dir, hf_logits,
                                                                    mode):
    """vLLM applies the grammar's mask to the logits before its sampler, so even its raw
    values of a constrained request are the allowed tokens': the tokens a choice cannot
    begin with are -inf, and raw_logprobs' allowed ones sum to 1 (what a client reading
    a choice's confidence from top_logprobs gets from vLLM)."""
    from kvledger.engine import StructuredOutputsParams

    llm = LLM(str(tiny_llama_dir), device="cpu", max_model_len=64, logprobs_mode=mode)
    choices = ["yes", "no", "maybe"]
    [out] = llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(
        temperature=0, max_tokens=4, logprobs=20,
        structured_outputs=StructuredOutputsParams(choice=choices)), use_tqdm=False)
    assert out.outputs[0].text in choices
    first = out.outputs[0].logprobs[0]
    allowed = {token for token, value in first.top if value > float("-inf")}
    assert 0 < len(allowed) < 20 and first.token_id in allowed
    tokenizer = llm.get_tokenizer()
    assert all(any(c.startswith(tokenizer.decode([t]).strip()) for c in choices)
               for t in allowed)
    row = hf_logits(PROMPT)[-1]
    if mode == "raw_logits":  # the model's own logits, where allowed
        assert all(value == pytest.approx(row[token].item(), abs=1e-4)
                   for token, value in first.top if token in allowed)
    else:
        assert sum(math.exp(value) for token, value in first.top
                   if token in allowed) == pytest.approx(1.0, abs=1e-4)
