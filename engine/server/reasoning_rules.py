"""The think-tag rule of each ``--reasoning-parser`` kvledger serves, read from vLLM 0.32's
parser of that name for its whole answers (``vllm/reasoning/``; the parser engine's
grammars in ``vllm/parser/``). vLLM reads a whole answer's text; ``reasoning.py`` reads
the same rule on token ids and streams it the same way.

Two families. The think-tag base rule (``BaseThinkingReasoningParser``: deepseek_r1, and
deepseek_v3, holo2 and poolside_v1, which hand a thinking chat to it): the answer is
reasoning until the first end marker, start markers in it dropped; what follows is
content as written; the reasoning tokens are those between a start marker and its end in
the output. The parser engine (``ParserEngine`` grammars: qwen3 and the rest): a grammar
of states, where a start marker inside reasoning is dropped, an end marker in the content
is dropped (``drops_late_end``), a tool-call opener ends the reasoning and stays in the
content (``implicit_end``, as the tool parser reads it), a start marker in the content may
open reasoning again (``reopens``: GLM's and Mistral's grammars), the reasoning's trailing
whitespace is cut (``strips_trailing_space``: the engine's default, which Qwen3's grammar
turns off), and every token read as reasoning counts but the grammar's other markers
(``tool_markers``: tool-call markup, text wherever it falls).

A prompt may end the reasoning itself (``prompt_end`` in ``reasoning.py``, vLLM's
``is_reasoning_end`` on the prompt): read back from its last token, an end marker (or an
implicit end) says so, a start marker or the current turn's start (``turn_markers``) says
not; Step3's parser takes an end marker anywhere in it (``prompt_end_anywhere``).

A chat's template variables may turn thinking off (``switch``; a chat that does not think
is all content, as written, with no reasoning tokens): each switch below is that parser's
reading of ``chat_template_kwargs``, with the model's chat template where it matters.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from kvledger.engine.settings.reasoning_parsers import REASONING_PARSERS

Switch = Callable[[Mapping[str, Any], "str | None"], bool]


@dataclass(frozen=True)
class ReasoningRule:
    """How one parser reads an answer (the module's docstring). ``start`` None: an end
    marker alone (step3). ``requires``: other tokens vLLM refuses a tokenizer without.
    ``models``: who writes these markers, for the line refusing a tokenizer that lacks
    them."""

    start: str | None
    end: str
    models: str
    implicit_end: str | None = None
    starts_in_reasoning: bool = True
    reopens: bool = False
    drops_late_end: bool = False
    strips_trailing_space: bool = False
    counts_unopened: bool = True  # reasoning tokens count without a start in the output
    switch: Switch | None = None  # None: every chat thinks
    requires: tuple[str, ...] = ()
    tool_markers: tuple[str, ...] = ()  # not counted as reasoning; kept as text if special
    turn_markers: tuple[str, ...] = ()  # where a prompt's current turn starts, if a token
    prompt_end_anywhere: bool = False  # an end marker anywhere in the prompt ends it


def enable_thinking(kwargs: Mapping[str, Any], _template: str | None) -> bool:
    """``Qwen3Parser``'s: ``enable_thinking``, default on, read as a truth value (an
    explicit null turns it off)."""
    return bool(kwargs.get("enable_thinking", True))


def thinking_or_enable_thinking(kwargs: Mapping[str, Any], _template: str | None) -> bool:
    """Kimi K2's, Ling 3's and Holo2's: on unless ``thinking`` or ``enable_thinking`` is
    set (not null), then either one's truth."""
    thinking, enable = kwargs.get("thinking"), kwargs.get("enable_thinking")
    return True if thinking is None and enable is None else bool(thinking) or bool(enable)


def glm_thinking(kwargs: Mapping[str, Any], template: str | None) -> bool:
    """``Glm47MoeParser``'s: as Kimi K2's, except that a ``false`` is ignored under GLM-5.3's
    template, which has no switch and always opens ``<think>``."""
    if (kwargs.get("thinking") is False or kwargs.get("enable_thinking") is False) \
            and _glm53_always_thinks(template):
        return True
    return thinking_or_enable_thinking(kwargs, template)


def _glm53_always_thinks(template: str | None) -> bool:
    """vLLM's test for GLM-5.3's template: GLM-4's prompt and calls, a ``Reasoning
    Effort:`` header, no ``enable_thinking``."""
    return isinstance(template, str) and "enable_thinking" not in template and all(
        part in template for part in ("[gMASK]<sop>", "Reasoning Effort:", "<tool_call>",
                                      "<arg_key>", "<arg_value>"))


def thinking_opt_in(kwargs: Mapping[str, Any], _template: str | None) -> bool:
    """``DeepSeekV3ReasoningParser``'s: off unless ``thinking`` or ``enable_thinking`` is
    true; off, the whole answer is content (its ``IdentityReasoningParser``)."""
    return bool(kwargs.get("thinking", False)) or bool(kwargs.get("enable_thinking", False))


_R1 = ReasoningRule("<think>", "</think>", "DeepSeek-R1 and its distills",
                    counts_unopened=False)
_DEEPSEEK_V3 = replace(_R1, models="DeepSeek-V3.1 and later", switch=thinking_opt_in)
_QWEN3 = ReasoningRule("<think>", "</think>", "Qwen3", implicit_end="<tool_call>",
                       drops_late_end=True, switch=enable_thinking, tool_markers=("</tool_call>",),
                       turn_markers=("<|im_start|>", "<|im_end|>"))
_GLM = ReasoningRule("<think>", "</think>", "GLM-4.5 and later", implicit_end="<tool_call>",
                     reopens=True, drops_late_end=True, strips_trailing_space=True,
                     switch=glm_thinking, tool_markers=("</tool_call>",),
                     turn_markers=("<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"))

RULES: dict[str, ReasoningRule] = {
    "deepseek_r1": _R1,
    "deepseek_v3": _DEEPSEEK_V3,
    "holo2": replace(_DEEPSEEK_V3, models="Holo2", switch=thinking_or_enable_thinking),
    "poolside_v1": replace(_DEEPSEEK_V3, models="Poolside's Laguna",
                           requires=("<assistant>",), turn_markers=("<assistant>",)),
    "qwen3": _QWEN3,
    "mimo": replace(_QWEN3, models="MiMo"),
    "seed_oss": replace(_QWEN3, start="<seed:think>", end="</seed:think>", models="Seed-OSS",
                        implicit_end="<seed:tool_call>", tool_markers=("</seed:tool_call>",),
                        turn_markers=("<seed:bos>", "<seed:eos>")),
    # Step-3.5's template always opens <think> and has no switch
    "step3p5": replace(_QWEN3, models="Step-3.5", strips_trailing_space=True, switch=None),
    "glm45": _GLM,
    "glm47": _GLM,
    "ling3": replace(_GLM, models="Ling 3", switch=thinking_or_enable_thinking),
    "kimi_k2": ReasoningRule("<think>", "</think>", "Kimi K2",
                             implicit_end="<|tool_calls_section_begin|>", drops_late_end=True,
                             strips_trailing_space=True, switch=thinking_or_enable_thinking,
                             tool_markers=("<|tool_calls_section_end|>",
                                           "<|tool_call_begin|>", "<|tool_call_end|>",
                                           "<|tool_call_argument_begin|>")),
    "minimax_m2": ReasoningRule("<think>", "</think>", "MiniMax-M2",
                                implicit_end="<minimax:tool_call>", drops_late_end=True,
                                strips_trailing_space=True, tool_markers=("</minimax:tool_call>",)),
    # Step3ReasoningParser: everything before the first </think> is reasoning, as written
    "step3": ReasoningRule(None, "</think>", "Step3", prompt_end_anywhere=True),
    # Magistral: the answer is content until [THINK]; [TOOL_CALLS] is its one call marker
    "mistral": ReasoningRule("[THINK]", "[/THINK]", "Magistral", implicit_end="[TOOL_CALLS]",
                             starts_in_reasoning=False, reopens=True, drops_late_end=True,
                             strips_trailing_space=True, requires=("[TOOL_CALLS]",),
                             tool_markers=("[ARGS]",)),
}


assert set(RULES) == set(REASONING_PARSERS), "a --reasoning-parser name without its rule"
