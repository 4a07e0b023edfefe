"""vLLM's offline structured outputs on ``LLM``: ``SamplingParams(structured_outputs=
StructuredOutputsParams(...))`` compiled at the engine's door, and
``LLM(structured_outputs_config=...)`` for how JSON is written. Random weights steered
toward whitespace by a ``logit_bias``: the output keeps to the constraint whatever."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from kvledger.engine import LLM, SamplingParams, StructuredOutputsParams
from kvledger.engine.errors import BadInput
from kvledger.engine.sampling.params import StructuredOutputsParams as FromParams

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                 "maximum": 99}},
          "required": ["n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), max_model_len=128, max_num_seqs=4, device="cpu",
               num_gpu_blocks_override=16)


def _whitespace(llm) -> dict[int, float]:
    tokenizer = llm.get_tokenizer()
    return {i: 6.0 for i in range(tokenizer.vocab_size)
            if (text := tokenizer.decode([i])) and not text.strip()}


def _texts(llm, constraint: StructuredOutputsParams, seeds=range(3), finished=True,
           **extra) -> list[str]:
    params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=40,
                             structured_outputs=constraint, **extra) for seed in seeds]
    outputs = llm.generate(["Answer:"] * len(params), params)
    if finished:
        assert all(o.finish_reason == "stop" for o in outputs), [o.text for o in outputs]
    return [o.text for o in outputs]


def test_each_constraint_kind(llm) -> None:
    assert FromParams is StructuredOutputsParams  # vLLM's import path works too
    for text in _texts(llm, StructuredOutputsParams(json=SCHEMA)):
        jsonschema.validate(json.loads(text), SCHEMA)
    assert all(re.fullmatch(r"[a-c]{3}", t)
               for t in _texts(llm, StructuredOutputsParams(regex="[a-c]{3}")))
    assert set(_texts(llm, StructuredOutputsParams(choice=["yes", "no"]))) <= {"yes", "no"}
    assert set(_texts(llm, StructuredOutputsParams(
        grammar='root ::= "x" ("y" | "z")'))) <= {"xy", "xz"}
    # Any object: random weights write keys on and on, so the cap may come first.
    for text in _texts(llm, StructuredOutputsParams(json_object=True), finished=False):
        assert text.lstrip().startswith("{")
    assert llm.engine.ledger.reserved_blocks == 0


def test_the_requests_layout_and_the_engines_config(llm, tiny_llama_dir) -> None:
    bias = _whitespace(llm)
    spaced = _texts(llm, StructuredOutputsParams(json=SCHEMA), logit_bias=bias, finished=False)
    assert all(any(c.isspace() for c in t) for t in spaced)
    compact = _texts(llm, StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True),
                     logit_bias=bias)
    assert all(t == json.dumps(json.loads(t), separators=(",", ":")) for t in compact)
    strict = LLM(str(tiny_llama_dir), max_model_len=128, max_num_seqs=4, device="cpu",
                 num_gpu_blocks_override=16, structured_outputs_config={
                     "backend": "guidance", "disable_any_whitespace": True})
    assert all(t == json.dumps(json.loads(t), separators=(",", ":"))
               for t in _texts(strict, StructuredOutputsParams(json=SCHEMA), logit_bias=bias))


def test_bad_constraints_are_bad_input(llm) -> None:
    with pytest.raises(BadInput, match="exactly one of"):
        StructuredOutputsParams(json=SCHEMA, regex="a")
    with pytest.raises(BadInput, match="exactly one of"):
        StructuredOutputsParams()
    with pytest.raises(BadInput, match="must be a StructuredOutputsParams"):
        SamplingParams(structured_outputs={"json": SCHEMA})
    with pytest.raises(BadInput, match="invalid grammar"):
        llm.generate("x", SamplingParams(structured_outputs=StructuredOutputsParams(
            grammar='root ::= ("a"')))
    with pytest.raises(BadInput, match="backend must be one of"):
        LLM("/nonexistent", structured_outputs_config={"backend": "nope"})
    assert llm.engine.ledger.reserved_blocks == 0
