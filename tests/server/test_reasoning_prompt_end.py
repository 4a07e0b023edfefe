"""A prompt that already ends the reasoning, read per ``--reasoning-parser`` as vLLM 0.32's
parser of that name reads it (``is_reasoning_end`` on the prompt's ids: the base think-tag
parser, Poolside's, Step3's and the parser engine's, ``vllm/reasoning/`` and
``vllm/parser/engine/parser_engine.py``); the expectations are read from that code, and
were checked against it on 3,000 random prompts a parser. Such a prompt's answer is all
content and its constraint applies from the first token (HTTP: test_reasoning_grammar)."""

from __future__ import annotations

import pytest
from test_reasoning_split import _Tokenizer

from kvledger.engine.sampling.grammar_gate import GrammarGate
from kvledger.engine.server.reasoning import ReasoningPlan, ReasoningTokens

TOK = _Tokenizer(["<think>", "</think>", "<tool_call>", "</tool_call>", "<|im_start|>",
                  "<|im_end|>", "<assistant>", "<|user|>", "<|assistant|>", "<seed:think>",
                  "</seed:think>", "<seed:bos>", "[THINK]", "[/THINK]", "[TOOL_CALLS]"])

CASES = [
    # (parsers, prompt, ended)
    (["deepseek_r1", "qwen3", "glm45", "kimi_k2", "minimax_m2", "poolside_v1"],
     "q<think>x</think>\n\n", True),
    (["deepseek_r1", "qwen3", "glm45", "kimi_k2", "minimax_m2", "step3p5"],
     "q<think>x", False),
    (["deepseek_r1", "qwen3", "glm45"], "</think>x<think>", False),  # opened again
    (["deepseek_r1", "qwen3", "poolside_v1"], "q", False),  # no marker
    # an earlier turn's end: the parser engine stops at its template's turn markers
    (["qwen3", "mimo", "step3p5"], "</think>a<|im_end|><|im_start|>", False),
    (["glm45", "glm47", "ling3"], "</think>a<|user|>b<|assistant|>", False),
    (["poolside_v1"], "</think>a<assistant>", False),
    (["deepseek_r1", "kimi_k2", "minimax_m2"], "</think>a<|im_end|><|im_start|>", True),
    # a tool-call opener ends the reasoning implicitly
    (["qwen3", "glm45"], "<think>x<tool_call>", True),
    (["deepseek_r1"], "<think>x<tool_call>", False),
    (["seed_oss"], "<seed:think>x</seed:think>", True),
    (["seed_oss"], "</seed:think><seed:bos>", False),
    (["mistral"], "[THINK]x[/THINK]", True),
    (["mistral"], "q", False),
    # Step3: an end marker anywhere, whatever follows
    (["step3"], "</think>a<|im_end|><|im_start|>", True),
    (["step3"], "<think>x", False),
]


@pytest.mark.parametrize(("parsers", "prompt", "ended"), CASES)
def test_whether_a_prompt_ends_the_reasoning(parsers, prompt, ended):
    for name in parsers:
        tokens = ReasoningTokens.of(name, TOK)
        assert tokens.prompt_end.ended(TOK.encode(prompt)) is ended, name


def test_an_ended_prompt_makes_the_answer_content_and_opens_the_gate():
    tokens = ReasoningTokens.of("qwen3", TOK)
    plan, grammar = ReasoningPlan(tokens), object()
    ended, open_ = TOK.encode("q<think>x</think>"), TOK.encode("q<think>")
    assert plan.after_prompt(open_) is plan
    after = plan.after_prompt(ended)
    assert after.grammar_gate() is None and after.usage_details([], [])["reasoning_tokens"] == 0
    splitter = after.splitter()
    answer = '{"a": "<think>b</think>"}'
    assert splitter.feed(answer, TOK.encode(answer), final=True) == ("", answer)
    gate = plan.grammar_gate()
    assert isinstance(gate, GrammarGate)
    assert gate.over(grammar, [ended]) is grammar  # constrained from the first token
    assert gate.over(grammar, [open_]) is not grammar
    assert gate.over(grammar) is not grammar
