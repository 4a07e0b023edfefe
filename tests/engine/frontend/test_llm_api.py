"""``LLM.generate`` (vLLM's shape) and the sampling rules."""

from __future__ import annotations

import pytest
import torch

from kvledger.engine import LLM, SamplingParams
from kvledger.engine.errors import BadInput
from kvledger.engine.sampling.sampler import Sampler


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), max_model_len=96, max_num_seqs=4, device="cpu",
               num_gpu_blocks_override=12)


def test_generate_takes_strings_and_token_lists_and_keeps_order(llm):
    tok = llm.get_tokenizer()
    prompts = ["The river flows", tok.encode("Hello there"), "A ledger"]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outputs = llm.generate(prompts, params)
    assert [o.prompt for o in outputs] == ["The river flows", None, "A ledger"]
    assert outputs[1].prompt_token_ids == tok.encode("Hello there")
    for out in outputs:
        assert len(out.token_ids) == 6 and out.finish_reason == "length"
        assert out.outputs[0].token_ids == out.token_ids and out.outputs[0].text == out.text
        assert out.text == tok.decode(out.token_ids)
    single = llm.generate("The river flows", params)
    assert single[0].token_ids == outputs[0].token_ids


def test_more_prompts_than_the_pool_holds_wait_their_turn(llm):
    # 12 blocks of 16 tokens; each request reserves 3 blocks: at most 4 run at once.
    params = [SamplingParams(temperature=0, max_tokens=20 + i, ignore_eos=True) for i in range(10)]
    outputs = llm.generate([[5 + i] * 20 for i in range(10)], params)
    assert [len(o.token_ids) for o in outputs] == [20 + i for i in range(10)]
    assert llm.engine.ledger.reserved_blocks == 0


def test_bad_prompts_are_bad_input_before_anything_runs(llm):
    with pytest.raises(BadInput, match="context limit"):
        llm.generate([[5] * 96], SamplingParams())
    with pytest.raises(BadInput, match="2 prompts but 1"):
        llm.generate(["a", "b"], [SamplingParams()])
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("kwargs", [
    {"temperature": -1}, {"temperature": float("nan")}, {"top_p": 0}, {"top_p": 1.5},
    {"top_k": -2}, {"max_tokens": 0}, {"max_tokens": 2.5}, {"stop": [""]}, {"stop": 3},
    {"stop_token_ids": [-1]}, {"seed": "x"}, {"seed": 2**64}, {"seed": -2**63 - 1},
    {"ignore_eos": "yes"},
])
def test_bad_sampling_params_are_bad_input(kwargs):
    with pytest.raises(BadInput):
        SamplingParams(**kwargs)


class _Seq:
    def __init__(self, params, generator=None):
        self.params, self.generator = params, generator


def test_sampler_greedy_top_k_and_top_p():
    sampler = Sampler(seed=0, device=torch.device("cpu"))
    logits = torch.tensor([[0.0, 5.0, 4.9, -1.0, 4.8]] * 1)

    def pick(**kwargs) -> int:
        return sampler(logits, [_Seq(SamplingParams(**kwargs))]).token_ids[0]

    assert pick(temperature=0) == 1
    assert {pick(temperature=5.0, top_k=2) for _ in range(200)} == {1, 2}
    # Probabilities ~ [.. .36 .33 .. .30]: top_p 0.5 keeps the two largest.
    assert {pick(temperature=1.0, top_p=0.5) for _ in range(200)} == {1, 2}
    assert {pick(temperature=100.0) for _ in range(300)} == {0, 1, 2, 3, 4}
    # A top_p that float32 rounds to 0 still keeps the top token (it used to keep none,
    # and torch.multinomial's error killed the engine).
    assert pick(temperature=1.0, top_p=1e-300) == 1


def test_a_vanishing_temperature_is_greedy_not_a_dead_engine(llm):
    # 1e-300 divides the logits to inf (NaN probabilities), which used to kill the engine
    # loop for every request; vLLM treats any temperature below 1e-5 as greedy.
    greedy = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    for temperature in (1e-300, 1e-6):
        tiny = llm.generate([[5, 6, 7]], SamplingParams(temperature=temperature, top_p=1e-300,
                                                        max_tokens=5, ignore_eos=True))
        assert tiny[0].token_ids == greedy[0].token_ids


def test_sampler_seeded_rows_do_not_depend_on_the_other_rows():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    params = SamplingParams(temperature=1.0, seed=7)

    def draw(extra_rows):
        sampler = Sampler(seed=extra_rows, device=torch.device("cpu"))
        gen = torch.Generator().manual_seed(7)
        seqs = [_Seq(SamplingParams(temperature=1.0)) for _ in range(extra_rows)] + [_Seq(params, gen)]
        return [sampler(logits[-len(seqs):], seqs).token_ids[-1] for _ in range(20)]

    assert draw(0) == draw(2)


def test_chat_goes_through_the_template_once_with_one_bos(llm):
    tok = llm.get_tokenizer()
    conversation = [{"role": "user", "content": "Tell me about the weather."}]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    [out] = llm.chat(conversation, params)
    expected = tok.encode(tok.apply_chat_template(conversation), add_special_tokens=False)
    assert out.prompt_token_ids == expected and expected.count(tok.token_to_id("<s>")) == 1
    assert out.token_ids == llm.generate([expected], params)[0].token_ids
    assert len(llm.chat([conversation, conversation], params)) == 2
