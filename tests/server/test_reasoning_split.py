"""--reasoning-parser's rules, read on token ids (``server/reasoning.py``): vLLM 0.32's
deepseek_r1 and qwen3, whole and token by token, and the tool parser reading only the
content after the reasoning."""

from __future__ import annotations

import pytest

from kvledger.engine.errors import BadInput
from kvledger.engine.server.reasoning import ReasoningPlan, ReasoningTokens
from kvledger.engine.server.tools.parsers import CallScanner

MARKERS = ["<think>", "</think>", "<tool_call>"]


class _Tokenizer:
    """Markers as single tokens, every other character a token of its own."""

    def __init__(self, markers=MARKERS) -> None:
        self.vocab = {m: 1000 + i for i, m in enumerate(markers)}
        self.text = {i: m for m, i in self.vocab.items()}

    def token_to_id(self, text: str) -> int | None:
        return self.vocab.get(text)

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(self.text.get(i, chr(i)) for i in ids)

    def encode(self, text: str) -> list[int]:
        ids, i = [], 0
        while i < len(text):
            marker = next((m for m in self.vocab if text.startswith(m, i)), None)
            ids.append(self.vocab[marker] if marker else ord(text[i]))
            i += len(marker) if marker else 1
        return ids


TOK = _Tokenizer()


def _whole(name: str, text: str, thinking: bool = True):
    plan = ReasoningPlan(ReasoningTokens.of(name, TOK), thinking)
    splitter = plan.splitter()
    ids = TOK.encode(text)
    splitter.feed(text, ids, final=True)
    return splitter.reasoning, splitter.content, plan.usage_details([splitter], [ids])


def _streamed(name: str, text: str, thinking: bool = True):
    splitter = ReasoningPlan(ReasoningTokens.of(name, TOK), thinking).splitter()
    ids = TOK.encode(text)
    reasoning = content = ""
    for n in range(1, len(ids) + 1):
        r, c = splitter.feed(TOK.decode(ids[:n]), ids[:n], final=n == len(ids))
        reasoning, content = reasoning + r, content + c
    return reasoning, content


CASES = [  # (parser, output, reasoning, content)
    ("deepseek_r1", "plan</think>answer", "plan", "answer"),
    ("deepseek_r1", "<think>plan</think>answer", "plan", "answer"),
    ("deepseek_r1", "all thought", "all thought", ""),       # no end: all reasoning
    ("deepseek_r1", "a</think>b</think>c", "a", "b</think>c"),
    ("deepseek_r1", "a<tool_call>b", "a<tool_call>b", ""),    # not its marker
    ("qwen3", "<think>plan</think>answer", "plan", "answer"),
    ("qwen3", "all thought", "all thought", ""),              # vLLM 0.32's engine rule
    ("qwen3", "a</think>b</think>c", "a", "bc"),              # a late </think> dropped
    ("qwen3", "a<tool_call>{}", "a", "<tool_call>{}"),        # a call ends reasoning
]


@pytest.mark.parametrize(("name", "text", "reasoning", "content"), CASES)
def test_whole_and_streamed_split_alike(name, text, reasoning, content) -> None:
    assert _whole(name, text)[:2] == (reasoning, content)
    assert _streamed(name, text) == (reasoning, content)


def test_qwen3_without_thinking_is_all_content_as_written() -> None:
    tokens = ReasoningTokens.of("qwen3", TOK)
    assert tokens.thinking({"enable_thinking": False}) is False
    assert tokens.thinking({}) is True
    assert ReasoningTokens.of("deepseek_r1", TOK).thinking({"enable_thinking": False})
    # Qwen3Parser.extract_reasoning returns the output untouched: no </think> dropped
    assert _whole("qwen3", "<think>x</think>y", thinking=False) == (
        "", "<think>x</think>y", {"reasoning_tokens": 0})
    assert _streamed("qwen3", "<think>x</think>y", thinking=False) == ("", "<think>x</think>y")


def test_reasoning_tokens_as_vllm_counts_them() -> None:
    # qwen3's engine counts what it read as reasoning; deepseek_r1's base rule only the
    # tokens between a <think> and its </think> in the output itself
    assert _whole("qwen3", "abc</think>de")[2] == {"reasoning_tokens": 3}
    assert _whole("deepseek_r1", "abc</think>de")[2] == {"reasoning_tokens": 0}
    assert _whole("deepseek_r1", "<think>abc</think>de")[2] == {"reasoning_tokens": 3}


def test_text_waits_for_the_markers_own_text() -> None:
    """The ids say reasoning ended; the cut waits until the marker's text is written."""
    splitter = ReasoningPlan(ReasoningTokens.of("qwen3", TOK)).splitter()
    ids = TOK.encode("ab</think>c")
    assert splitter.feed("ab", ids[:3], final=False) == ("", "")
    assert splitter.feed("ab</think>c", ids, final=True) == ("ab", "c")


def test_the_tool_parser_reads_only_the_content() -> None:
    text = ('I should call it. <tool_call> is how.</think>\n<tool_call>\n'
            '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')
    reasoning, content, _ = _whole("deepseek_r1", text)
    assert reasoning == "I should call it. <tool_call> is how."
    scanner = CallScanner("hermes")
    scanner.feed(content, final=True)
    assert [c.name for c in scanner.calls] == ["get_weather"] and scanner.content == ""


def test_a_tokenizer_without_the_markers_is_refused() -> None:
    with pytest.raises(BadInput, match="no single token for <think> or </think>"):
        ReasoningTokens.of("qwen3", _Tokenizer(["<tool_call>"]))
