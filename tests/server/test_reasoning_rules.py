"""Each --reasoning-parser beyond qwen3 and deepseek_r1, read on token ids as vLLM 0.32's
parser of that name reads a whole answer, whole and token by token alike: the
expectations below are read from its code (``vllm/reasoning/``, ``vllm/parser/``), not
from kvledger's rules."""

from __future__ import annotations

import pytest
from test_reasoning_split import _Tokenizer

from kvledger.engine.errors import BadInput
from kvledger.engine.server.reasoning import ReasoningPlan, ReasoningTokens
from kvledger.engine.server.reasoning_rules import (
    RULES,
    enable_thinking,
    glm_thinking,
    thinking_opt_in,
    thinking_or_enable_thinking,
)
from kvledger.engine.settings.reasoning_parsers import (
    REFUSED_REASONING_PARSERS,
    VLLM_REASONING_PARSERS,
)

MARKERS = ["<think>", "</think>", "<tool_call>", "<seed:think>", "</seed:think>",
           "<seed:tool_call>", "<|tool_calls_section_begin|>", "<minimax:tool_call>",
           "[THINK]", "[/THINK]", "[TOOL_CALLS]", "<assistant>", "</tool_call>"]
TOK = _Tokenizer(MARKERS)


def _split(name: str, kwargs: dict, text: str, streamed: bool = False):
    tokens = ReasoningTokens.of(name, TOK)
    plan = ReasoningPlan(tokens, tokens.thinking(kwargs))
    splitter, ids = plan.splitter(), TOK.encode(text)
    reasoning = content = ""
    for n in range(1, len(ids) + 1) if streamed else [len(ids)]:
        r, c = splitter.feed(TOK.decode(ids[:n]), ids[:n], final=n == len(ids))
        reasoning, content = reasoning + r, content + c
    assert (reasoning, content) == (splitter.reasoning, splitter.content)
    return reasoning, content, plan.usage_details([splitter], [ids])["reasoning_tokens"]


CASES = [  # (parser, chat_template_kwargs, output, reasoning, content)
    # DeepSeekV3ReasoningParser: thinking is opt-in; off, the output is content as written
    ("deepseek_v3", {}, "<think>a</think>b", "", "<think>a</think>b"),
    ("deepseek_v3", {"thinking": True}, "a</think>b</think>c", "a", "b</think>c"),
    ("deepseek_v3", {"enable_thinking": True}, "<think>a</think>b", "a", "b"),
    # holo2: the same rule, thinking on unless a switch says otherwise
    ("holo2", {}, "a</think>b", "a", "b"),
    ("holo2", {"thinking": False}, "a</think>b", "", "a</think>b"),
    ("poolside_v1", {"thinking": True}, "a</think>b", "a", "b"),
    # Qwen3's grammar with other wrappers (seed_oss) or another tool format (mimo)
    ("mimo", {}, "a<tool_call>{}", "a", "<tool_call>{}"),
    ("mimo", {"enable_thinking": False}, "a</think>b", "", "a</think>b"),
    ("seed_oss", {}, "<seed:think>p</seed:think>x</seed:think>", "p", "x"),
    ("seed_oss", {}, "a<seed:tool_call>f", "a", "<seed:tool_call>f"),
    ("seed_oss", {}, "a</think>b", "a</think>b", ""),  # not its marker
    # step3p5: Qwen3's grammar, always thinking, the reasoning's trailing space cut
    ("step3p5", {"enable_thinking": False}, "plan \n</think>\nanswer", "plan", "\nanswer"),
    # GLM's grammar: <think> in the content opens reasoning again; whitespace is cut
    # only at the reasoning's end
    ("glm45", {}, "a \n</think>b <think>c</think>d</think>", "a \nc", "b d"),
    ("glm45", {}, "a<tool_call>f", "a", "<tool_call>f"),
    ("glm45", {"thinking": False}, "a</think>b", "", "a</think>b"),
    ("glm47", {"thinking": False, "enable_thinking": True}, "a</think>b", "a", "b"),
    ("ling3", {}, "a</think>b<think>c", "ac", "b"),
    ("ling3", {"enable_thinking": False}, "a</think>b", "", "a</think>b"),
    # Kimi K2: the tool section ends reasoning; no reopening
    ("kimi_k2", {}, "plan <|tool_calls_section_begin|>x", "plan",
     "<|tool_calls_section_begin|>x"),
    ("kimi_k2", {}, "a</think>b<think>c</think>", "a", "b<think>c"),
    ("kimi_k2", {"thinking": False}, "a</think>b", "", "a</think>b"),
    # MiniMax-M2: no switch; its tool block ends reasoning
    ("minimax_m2", {"enable_thinking": False}, "plan\n</think>\n\nok</think>", "plan",
     "\n\nok"),
    ("minimax_m2", {}, "a<minimax:tool_call>b", "a", "<minimax:tool_call>b"),
    # Step3ReasoningParser: all before the first </think>, as written
    ("step3", {}, "a<think>b</think>c</think>d", "a<think>b", "c</think>d"),
    ("step3", {}, "all thought", "all thought", ""),
    # Magistral: content until [THINK], which may open reasoning again
    ("mistral", {}, "pre[THINK]plan[/THINK]answer[/THINK]", "plan", "preanswer"),
    ("mistral", {}, "no thinking", "", "no thinking"),
    ("mistral", {}, "[THINK]a [TOOL_CALLS]f{}", "a", "[TOOL_CALLS]f{}"),
    ("mistral", {"enable_thinking": False}, "[THINK]a[/THINK]b[THINK]c[/THINK]d", "ac", "bd"),
]


@pytest.mark.parametrize(("name", "kwargs", "text", "reasoning", "content"), CASES)
def test_whole_and_streamed_split_as_vllm(name, kwargs, text, reasoning, content) -> None:
    assert _split(name, kwargs, text)[:2] == (reasoning, content)
    assert _split(name, kwargs, text, streamed=True)[:2] == (reasoning, content)


@pytest.mark.parametrize(("name", "kwargs", "text", "count"), [
    ("step3", {}, "a<think>b</think>c", 3),  # everything before </think>
    ("deepseek_v3", {"thinking": True}, "ab</think>c", 0),  # only inside <think>...
    ("deepseek_v3", {"thinking": True}, "<think>ab</think>c", 2),
    ("deepseek_v3", {}, "<think>ab</think>c", 0),  # not thinking: no reasoning read
    ("glm45", {}, "ab</think>c<think>d", 3),  # the engine's: all it read as reasoning
    ("mistral", {}, "x[THINK]ab[/THINK]y", 2),
    ("kimi_k2", {"thinking": False}, "ab</think>c", 0),
    ("qwen3", {}, "a</tool_call>b</think>c", 2),  # tool markup is not counted
])
def test_reasoning_tokens_as_vllm_counts_them(name, kwargs, text, count) -> None:
    assert _split(name, kwargs, text)[2] == count


def test_the_chat_switches_read_the_kwargs_as_vllm_does() -> None:
    assert [enable_thinking(k, None) for k in ({}, {"enable_thinking": None},
                                               {"enable_thinking": 0})] == [True, False, False]
    assert [thinking_or_enable_thinking(k, None) for k in (
        {"thinking": None, "enable_thinking": None}, {"thinking": None, "enable_thinking": 0},
        {"thinking": 0, "enable_thinking": 1})] == [True, False, True]
    assert [thinking_opt_in(k, None) for k in ({}, {"thinking": None}, {"thinking": 1})] \
        == [False, False, True]
    # GLM-5.3's template has no switch: a false is ignored there (only a false)
    glm53 = "[gMASK]<sop> Reasoning Effort: <tool_call><arg_key><arg_value>"
    assert glm_thinking({"enable_thinking": False}, glm53) is True
    assert glm_thinking({"enable_thinking": 0}, glm53) is False
    assert glm_thinking({"enable_thinking": False}, glm53 + "enable_thinking") is False


def test_a_tokenizer_without_what_the_parser_needs_is_refused() -> None:
    with pytest.raises(BadInput, match=r"no single token for <assistant>; .*Laguna"):
        ReasoningTokens.of("poolside_v1", _Tokenizer(["<think>", "</think>"]))
    with pytest.raises(BadInput, match=r"no single token for \[TOOL_CALLS\]"):
        ReasoningTokens.of("mistral", _Tokenizer(["[THINK]", "[/THINK]"]))
    assert ReasoningTokens.of("step3", _Tokenizer(["</think>"])).start_id is None


def test_every_vllm_name_is_served_or_refused_with_why() -> None:
    assert len(VLLM_REASONING_PARSERS) == 38  # vLLM 0.32's registry
    assert not set(RULES) & set(REFUSED_REASONING_PARSERS)
    assert all(why and "\n" not in why for why in REFUSED_REASONING_PARSERS.values())


def test_a_refused_name_says_why_and_lists_the_served() -> None:
    from kvledger.engine.settings.serve_config import ServeConfig
    from kvledger.engine.settings.vllm_rules import RULES as FLAG_RULES
    from kvledger.engine.settings.vllm_rules import refusal

    with pytest.raises(BadInput) as refused:
        ServeConfig(reasoning_parser="openai_gptoss")
    assert str(refused.value) == refusal("--reasoning-parser", ["openai_gptoss"],
                                         FLAG_RULES["--reasoning-parser"])  # plan's line
    assert "(only deepseek_r1, deepseek_v3, glm45, glm47, holo2, kimi_k2, ling3, mimo, " \
        "minimax_m2, mistral, poolside_v1, qwen3, seed_oss, step3 or step3p5): gpt-oss's " \
        "reasoning is Harmony's analysis channel" in str(refused.value)
    with pytest.raises(BadInput, match=r"or step3p5\)$"):  # a name vLLM lacks: no why
        ServeConfig(reasoning_parser="thinker")


def test_the_constraint_waits_only_for_a_reasoning_the_answer_starts_in() -> None:
    """An output constraint waits for the reasoning's end where the answer starts in
    reasoning; where it starts in content (Magistral's) or the chat does not think, it
    applies from the first token, as vLLM's parser engine counts the reasoning ended."""
    for name in ("qwen3", "glm45", "step3", "deepseek_r1"):
        tokens = ReasoningTokens.of(name, TOK)
        gate = ReasoningPlan(tokens).grammar_gate()
        assert gate is not None and gate.after == {tokens.end_id}
    assert ReasoningPlan(ReasoningTokens.of("mistral", TOK)).grammar_gate() is None
    assert ReasoningPlan(ReasoningTokens.of("qwen3", TOK), thinking=False).grammar_gate() \
        is None
