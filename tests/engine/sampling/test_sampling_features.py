"""The OpenAI sampling features on the engine side: penalties, min_tokens, logit_bias,
top_k 0, logprobs and prompt logprobs (against transformers on the same weights), stop
strings kept in the text, and grammars (through a fake matcher, so these tests do not
depend on engine/sampling/grammar.py). Every test leaves the KV pool empty."""

from __future__ import annotations

import random

import pytest
import torch
import transformers
from _engine_helpers import make_engine

from kvledger.engine.core import runner as model_runner
from kvledger.engine.core.engine import LLMEngine
from kvledger.engine.core.sequence import Sequence
from kvledger.engine.errors import BadInput
from kvledger.engine.sampling.logprobs import logprobs_of
from kvledger.engine.sampling.params import SamplingParams
from kvledger.engine.sampling.penalties import PenaltyCounts
from kvledger.engine.sampling.sampler import process_logits

NEG_INF = float("-inf")
PROMPT = [17, 300, 42, 901, 77, 5, 640, 12, 250, 99, 1000, 3, 64, 128, 511]


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    return make_engine(tiny_llama_dir)


@pytest.fixture(autouse=True)
def pool_empty_after(request):
    yield
    if "engine" in request.fixturenames:
        engine = request.getfixturevalue("engine")
        assert (engine.ledger.reserved_blocks, engine.ledger.used_blocks) == (0, 0)


@pytest.fixture(scope="module")
def hf_logprobs(tiny_llama_dir):
    """Teacher-forced log_softmax of transformers' logits ``[len(ids), vocab]``."""
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    model.eval()

    def logprobs(ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)

    return logprobs


def run(engine: LLMEngine, *requests: tuple[list[int], SamplingParams]) -> list:
    """Run the requests together to the end; their final outputs in order."""
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(f"q{i}", prompt, params)
    final = {}
    while engine.has_unfinished_requests():
        final.update({out.request_id: out for out in engine.step() if out.finished})
    return [final[f"q{i}"] for i in range(len(requests))]


def greedy(**kwargs) -> SamplingParams:
    return SamplingParams(**{"temperature": 0, "max_tokens": 8, "ignore_eos": True, **kwargs})


# -- the processing functions, on small tensors ------------------------------------------

def apply_penalties(logits, prompt, output, params):
    return PenaltyCounts(prompt, logits.shape[-1]).apply(logits, output, params)


def test_penalties_follow_vllms_formulas():
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0])
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    out = apply_penalties(logits, [0], [3, 3, 1], params)
    # Repetition over prompt and output: 0, 1, 3 seen (2 -> 1, -1 -> -2, 3 -> 1.5); then
    # frequency and presence over the output: 3 twice (-1 - 0.25), 1 once (-0.5 - 0.25).
    assert out.tolist() == [1.0, -2.75, 0.5, 0.25, -2.0]
    assert apply_penalties(logits, [0], [], params).tolist() == [1.0, -1.0, 0.5, 3.0, -2.0]
    presence_only = SamplingParams(presence_penalty=-1.0)
    assert apply_penalties(logits, [0], [4, 4], presence_only).tolist() == [2.0, -1.0, 0.5, 3.0, -1.0]


def _seq(params: SamplingParams, output: list[int] = ()) -> Sequence:
    seq = Sequence("s", [0], params, 16, None, None, None)
    seq.output_token_ids = list(output)
    return seq


def test_process_logits_bias_min_tokens_and_never_an_all_masked_row():
    logits = torch.tensor([1.0, 4.0, 2.0, 3.0, 0.0])
    eos = frozenset({1})
    assert process_logits(logits, _seq(SamplingParams(logit_bias={4: 100})), eos).argmax() == 4
    assert process_logits(logits, _seq(SamplingParams(logit_bias={1: -100})), eos).argmax() == 3
    # min_tokens masks EOS and stop token ids until that many tokens are out.
    params = SamplingParams(min_tokens=2, stop_token_ids=[3, 4096])  # 4096: beyond the vocab
    assert process_logits(logits, _seq(params, [2]), eos).tolist() == [1.0, NEG_INF, 2.0, NEG_INF, 0.0]
    assert torch.equal(process_logits(logits, _seq(params, [2, 2]), eos), logits)
    ignoring = SamplingParams(min_tokens=2, ignore_eos=True)  # EOS does not stop: not masked
    assert torch.equal(process_logits(logits, _seq(ignoring), eos), logits)
    # A grammar that allows only EOS wins over min_tokens; one that allows nothing leaves
    # the raw row (its matcher refuses the token then): no row reaches argmax all -inf.
    done = SamplingParams(min_tokens=3, grammar=ForcedGrammar([], eos=1))
    assert process_logits(logits, _seq(done), eos).tolist() == [NEG_INF, 4.0] + [NEG_INF] * 3
    assert torch.equal(process_logits(logits, _seq(SamplingParams(grammar=NothingGrammar())), eos),
                       logits)
    assert torch.equal(logits, torch.tensor([1.0, 4.0, 2.0, 3.0, 0.0]))  # the raw row untouched


@pytest.mark.parametrize("kwargs", [
    {"presence_penalty": 2.5}, {"frequency_penalty": -3}, {"frequency_penalty": float("nan")},
    {"presence_penalty": "1"}, {"repetition_penalty": 0}, {"repetition_penalty": float("inf")},
    {"min_tokens": -1}, {"min_tokens": 9, "max_tokens": 8}, {"min_tokens": True},
    {"logit_bias": {3: 101}}, {"logit_bias": {-1: 1}}, {"logit_bias": {"3": 1}},
    {"logit_bias": [3]}, {"logprobs": 21}, {"logprobs": -1}, {"prompt_logprobs": 2.0},
    {"include_stop_str_in_output": 1}, {"grammar": "json"}, {"top_k": -2},
])
def test_bad_params_are_bad_input_naming_the_field(kwargs):
    with pytest.raises(BadInput, match=next(iter(kwargs))):
        SamplingParams(**kwargs)


# -- through the engine --------------------------------------------------------------------

def test_a_large_frequency_penalty_prevents_greedy_repeats(engine):
    prompt = [5, 6, 7, 8, 9]
    plain, penalized = run(engine, (prompt, greedy(max_tokens=12)),
                           (prompt, greedy(max_tokens=12, frequency_penalty=2.0)))
    assert len(set(plain.token_ids)) < 12  # the tiny model repeats itself greedily
    assert len(set(penalized.token_ids)) == 12
    assert penalized.token_ids[0] == plain.token_ids[0]  # nothing to penalize yet


def test_logit_bias_forces_and_forbids_tokens_and_ids_beyond_the_vocab_are_refused(engine):
    plain, forced = run(engine, (PROMPT, greedy(logprobs=20)),
                        (PROMPT, greedy(logit_bias={700: 100}, logprobs=20)))
    assert plain.token_ids[0] != 700 and forced.token_ids == [700] * 8
    # Logprobs are the raw model's: the bias does not show in them.
    assert [t for t, _ in forced.logprobs[0].top] == [t for t, _ in plain.logprobs[0].top]
    assert forced.logprobs[0].rank > 1
    first = plain.token_ids[0]
    forbidden = run(engine, (PROMPT, greedy(max_tokens=1, logit_bias={first: -100})))[0]
    assert forbidden.token_ids[0] != first
    vocab = engine.runner.config.vocab_size
    with pytest.raises(BadInput, match="logit_bias"):
        engine.add_request("far", PROMPT, greedy(logit_bias={vocab: 1.0}))


def test_min_tokens_holds_back_eos_stop_tokens_and_stop_strings(engine):
    eos = min(engine.tokenizer.eos_token_ids)
    to_eos = {"temperature": 0, "max_tokens": 8, "logit_bias": {eos: 100}}
    at_once, held = run(engine, (PROMPT, SamplingParams(**to_eos)),
                        (PROMPT, SamplingParams(**to_eos, min_tokens=4)))
    assert (at_once.token_ids, at_once.finish_reason) == ([eos], "stop")
    assert eos not in held.token_ids[:4] and held.token_ids[4:] == [eos]
    assert held.finish_reason == "stop"
    plain = run(engine, (PROMPT, greedy()))[0]
    first = plain.token_ids[0]
    stop_id, stop_id_held = run(engine, (PROMPT, greedy(stop_token_ids=[first])),
                                (PROMPT, greedy(stop_token_ids=[first], min_tokens=3)))
    assert stop_id.token_ids == [first] and stop_id.finish_reason == "stop"
    assert first not in stop_id_held.token_ids[:3] and len(stop_id_held.token_ids) >= 3
    text = engine.tokenizer.decode(plain.token_ids[:1])
    stop_str, stop_str_held = run(engine, (PROMPT, greedy(stop=text)),
                                  (PROMPT, greedy(stop=text, min_tokens=2, max_tokens=2)))
    assert stop_str.text == "" and stop_str.finish_reason == "stop"
    assert stop_str_held.text == engine.tokenizer.decode(plain.token_ids[:2])
    assert stop_str_held.finish_reason == "length"


def test_include_stop_str_in_output_keeps_the_matched_stop_string(engine):
    plain = run(engine, (PROMPT, greedy(max_tokens=12)))[0]
    stop = plain.text[8:11]
    at = plain.text.index(stop)
    cut, kept = run(engine, (PROMPT, greedy(max_tokens=12, stop=["\x00never", stop])),
                    (PROMPT, greedy(max_tokens=12, stop=stop, include_stop_str_in_output=True)))
    assert (cut.text, cut.finish_reason) == (plain.text[:at], "stop")
    assert (kept.text, kept.finish_reason) == (plain.text[:at + len(stop)], "stop")


def test_top_k_zero_is_off(engine):
    assert not SamplingParams(top_k=0).greedy
    sampled = {"temperature": 1.0, "seed": 11, "max_tokens": 12, "ignore_eos": True}
    zero, off = run(engine, (PROMPT, SamplingParams(**sampled, top_k=0)),
                    (PROMPT, SamplingParams(**sampled, top_k=-1)))
    assert zero.token_ids == off.token_ids
    assert len(set(zero.token_ids)) > 1


def test_logprobs_are_the_raw_models_with_rank_and_a_sorted_top(engine, hf_logprobs):
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=6, ignore_eos=True,
                            logprobs=3, prompt_logprobs=2)
    greedy_out, out = run(engine, (PROMPT, greedy(logprobs=0)), (PROMPT, params))
    reference = hf_logprobs(PROMPT + out.token_ids)
    assert len(out.logprobs) == len(out.token_ids) == 6
    for j, (token_id, lp) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        row = reference[len(PROMPT) - 1 + j]
        assert lp.token_id == token_id
        assert lp.logprob == pytest.approx(row[token_id].item(), abs=1e-4)
        assert lp.rank == int((row > row[token_id]).sum()) + 1
        assert [t for t, _ in lp.top] == row.topk(3).indices.tolist()
        values = [v for _, v in lp.top]
        assert values == sorted(values, reverse=True)
        assert values == pytest.approx(row.topk(3).values.tolist(), abs=1e-4)
    assert any(lp.rank > 3 for lp in out.logprobs)  # reported though not in the top 3
    # Greedy: rank 1; k == 0: the token alone.
    assert all(lp.rank == 1 and lp.top == [] for lp in greedy_out.logprobs)
    # Prompt logprobs: the first token has none; the others are teacher-forced.
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(PROMPT)
    for i, lp in enumerate(out.prompt_logprobs[1:], start=1):
        row = reference[i - 1]
        assert lp.token_id == PROMPT[i]
        assert lp.logprob == pytest.approx(row[PROMPT[i]].item(), abs=1e-4)
        assert lp.rank == int((row > row[PROMPT[i]]).sum()) + 1
        assert [t for t, _ in lp.top] == row.topk(2).indices.tolist()
    assert greedy_out.prompt_logprobs is None and greedy_out.outputs[0].logprobs is greedy_out.logprobs


def test_prompt_logprobs_are_the_same_chunked_or_not_and_match_the_next_tokens(
        engine, tiny_llama_dir, monkeypatch):
    prompt = [random.Random(5).randrange(6, 1000) for _ in range(45)]
    params = greedy(max_tokens=3, logprobs=4, prompt_logprobs=4)
    whole = run(engine, (prompt, params))[0]
    monkeypatch.setattr(model_runner, "PROMPT_LOGPROBS_ROWS", 7)  # slices across chunks too
    chunked_engine = make_engine(tiny_llama_dir, max_num_batched_tokens=16)
    seen = []
    execute = chunked_engine.runner.execute
    monkeypatch.setattr(chunked_engine.runner, "execute",
                        lambda batch: seen.append(len(batch.prefills)) or execute(batch))
    chunked = run(chunked_engine, (prompt, params))[0]
    assert seen == [1, 1, 1, 0, 0]  # three chunks (the last one samples), two decodes
    assert [lp and lp.token_id for lp in chunked.prompt_logprobs] == \
           [None, *prompt[1:]] == [lp and lp.token_id for lp in whole.prompt_logprobs]
    for a, b in zip(chunked.prompt_logprobs[1:], whole.prompt_logprobs[1:], strict=True):
        assert (a.rank, [t for t, _ in a.top]) == (b.rank, [t for t, _ in b.top])
        assert a.logprob == pytest.approx(b.logprob, abs=1e-5)
    assert chunked.token_ids == whole.token_ids
    # Teacher forcing: the prompt extended by the generated tokens scores them as the
    # generation did.
    extended = run(engine, (prompt + whole.token_ids, greedy(max_tokens=1, prompt_logprobs=4)))[0]
    for a, b in zip(extended.prompt_logprobs[len(prompt):], whole.logprobs, strict=True):
        assert (a.token_id, a.rank, [t for t, _ in a.top]) == (b.token_id, b.rank, [t for t, _ in b.top])
        assert a.logprob == pytest.approx(b.logprob, abs=1e-5)
    assert (chunked_engine.ledger.reserved_blocks, chunked_engine.ledger.used_blocks) == (0, 0)


# -- grammars, through a fake matcher -------------------------------------------------------

class ForcedMatcher:
    """Allows exactly ``expected[position]``; terminated after the last (EOS)."""

    dead_end = False

    def __init__(self, expected: list[int]) -> None:
        self.expected, self.position = expected, 0

    @property
    def is_terminated(self) -> bool:
        return self.position == len(self.expected)

    def fill_mask(self, logits_row: torch.Tensor) -> None:
        allowed = self.expected[min(self.position, len(self.expected) - 1)]
        keep = logits_row[allowed].clone()
        logits_row.fill_(NEG_INF)
        logits_row[allowed] = keep

    apply_mask = fill_mask  # the same mask again (no state of its own changes)

    def accept(self, token_id: int) -> bool:
        if self.is_terminated or token_id != self.expected[self.position]:
            return False
        self.position += 1
        return True


class ForcedGrammar:
    """A fake compiled grammar: the tokens ``forced``, then EOS."""

    def __init__(self, forced: list[int], eos: int) -> None:
        self.expected = [*forced, eos]

    def matcher(self) -> ForcedMatcher:
        return ForcedMatcher(self.expected)


class NothingGrammar:
    """Masks nothing yet accepts no token: a matcher at odds with its own mask (a bug, not
    a dead end of the client's grammar), which fails its request alone."""

    def matcher(self):
        grammar = self

        class Matcher:
            is_terminated = False
            dead_end = False

            def fill_mask(self, logits_row: torch.Tensor) -> None:
                pass

            apply_mask = fill_mask

            def accept(self, token_id: int) -> bool:
                grammar.refused = token_id
                return False

        return Matcher()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_grammar_forces_its_tokens_and_finishes_with_stop(engine, temperature):
    eos = min(engine.tokenizer.eos_token_ids)
    forced = [700, 12, 700, 950]
    grammar = ForcedGrammar(forced, eos)
    base = {"temperature": temperature, "seed": 1, "max_tokens": 20, "grammar": grammar}
    plain, ignoring, min_tokens = run(
        engine, (PROMPT, SamplingParams(**base)),
        (PROMPT, SamplingParams(**base, ignore_eos=True)),
        # The grammar allows only EOS after its tokens; min_tokens forbids EOS: the grammar wins.
        (PROMPT, SamplingParams(**base, min_tokens=10)))
    for out in (plain, ignoring, min_tokens):
        assert out.token_ids == [*forced, eos] and out.finish_reason == "stop"


def test_a_refused_token_fails_only_that_request(engine):
    nothing = NothingGrammar()
    refused, bystander, reference = run(engine, (PROMPT, greedy(grammar=nothing, logprobs=1)),
                                        (PROMPT[:7], greedy()), (PROMPT[:7], greedy()))
    assert refused.finish_reason == "error" and "grammar" in refused.error
    assert refused.token_ids == [] and refused.logprobs == []
    assert nothing.refused == run(engine, (PROMPT, greedy(max_tokens=1)))[0].token_ids[0]
    assert bystander.finish_reason == "length" and bystander.token_ids == reference.token_ids


def test_a_matcher_that_cannot_start_gives_the_reservation_back(engine):
    class Broken:
        def matcher(self):
            raise RuntimeError("cannot compile")

    with pytest.raises(RuntimeError, match="cannot compile"):
        engine.add_request("broken", PROMPT, greedy(grammar=Broken()))
    assert not engine.has_unfinished_requests()


def test_processing_and_logprobs_stay_on_the_logits_device():
    # meta refuses a CPU tensor meeting a meta one, as CUDA would (tests/engine/core/test_device_paths.py).
    meta = torch.device("meta")
    params = SamplingParams(logit_bias={1: 5.0}, repetition_penalty=1.3, frequency_penalty=0.5,
                            presence_penalty=0.5, min_tokens=4, stop_token_ids=[2],
                            grammar=ForcedGrammar([3], eos=0))
    row = process_logits(torch.zeros(8, device=meta), _seq(params, [1, 3]), frozenset({0}))
    assert row.device == meta and row.shape == (8,)
    targets = torch.zeros(3, dtype=torch.long, device=meta)
    logprobs_of(torch.zeros(3, 8, device=meta), targets, [2, 0, 5])  # queued; read() would copy


def test_allowed_token_ids_select_the_row_and_build_their_index_once():
    logits = torch.tensor([1.0, 4.0, 2.0, 3.0, 0.0])
    seq = _seq(SamplingParams(allowed_token_ids=[4, 2]))
    assert process_logits(logits, seq, frozenset()).tolist() == \
        [NEG_INF, NEG_INF, 2.0, NEG_INF, 0.0]
    index = seq.allowed_index(logits.device)
    process_logits(logits, seq, frozenset())
    # A vocabulary's worth of ids would cost every step ~13 ms to build again.
    assert seq.allowed_index(logits.device) is index
