"""How a chat request's ``tools`` and ``tool_choice`` are served: ``tool_plan`` decides,
once per request, which parser reads the answer back and which grammar constrains it.

- ``"none"``: the tools are in the prompt (vLLM's default), the answer is text.
- ``"auto"``: the model chooses; its text is parsed (``parsers``). As in vLLM, the
  server must be started with ``--enable-auto-tool-choice`` and a parser, else a 400.
- ``"required"`` or a named function: the output is constrained by a Lark grammar
  (llguidance, compiled like any structured output) to calls in the model family's own
  format, each naming a declared function with arguments valid against its schema
  (``%json``; for the formats that write arguments one by one, qwen3_coder, seed_oss,
  glm45, poolside_v1, k2_horizon, minimax_m2, step3, pythonic, olmo3 and lfm2,
  ``param_grammars``). A named function is called exactly once, as OpenAI and vLLM answer it
  (vLLM constrains the output to that function's arguments); ``"required"`` makes one call
  with ``parallel_tool_calls: false``, else one or more.

The format is ``--tool-call-parser``'s, else the one the model's chat template shows
(``<function=``: qwen3_coder, seed_oss in ``<seed:tool_call>``; ``<tool_call>``: hermes; ``[TOOL_CALLS]``: mistral;
``<|python_tag|>``: llama3_json; ``<｜tool▁calls▁begin｜>``: deepseek_v3 when it fences
the arguments as a json code block, else deepseek_v31; ``<|tool_calls_section_begin|>``:
kimi_k2; ``<tool_call>`` with ``<arg_key>``: glm45;
``<minimax:tool_call>``: minimax_m2; ``<｜tool_calls_begin｜>``: step3;
``<|action_start|><|plugin|>``: internlm; ``<longcat_tool_call>``: longcat;
``<tool_calls>``: hunyuan_a13b when the template asks replies to begin ``助手：``, else
jamba; ``<function_calls>``: olmo3; ``<ifm|tool_calls>``: k2_horizon;
``<|tool_call_start|>``: lfm2; ``<|tool_call|>``: granite; ``<tool_call>`` with
Granite's ``<|start_of_role|>``: granite4; ``<function_call>``: granite-20b-fc;
``functools[``: phi4_mini_json), else hermes. A format's markers that the tokenizer
holds as special tokens (Mistral's ``[TOOL_CALLS]``, Llama's ``<|python_tag|>``) are kept
in the text the parser reads (``ToolPlan.kept_ids``; decoding drops every other special
token), and the grammar writes them as those tokens.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any

from kvledger.engine.server.tools import kimi_format as kimi
from kvledger.engine.server.tools.deepseek_format import (
    CALL_BEGIN,
    CALL_END,
    CALLS_BEGIN,
    CALLS_END,
    SEP,
    V3_ARGUMENTS,
    V3_CLOSE,
)
from kvledger.engine.server.tools.formats import ARGS, CONTROL_TOKENS
from kvledger.engine.server.tools.granite3_format import TOOL_TOKEN as GRANITE_TOOL_TOKEN
from kvledger.engine.server.tools.granite_format import FUNCTION_CALL
from kvledger.engine.server.tools.hunyuan_format import REPLY as HUNYUAN_REPLY
from kvledger.engine.server.tools.internlm_format import ACTION_END, CALL_START
from kvledger.engine.server.tools.jamba_format import TAG_END as LIST_END
from kvledger.engine.server.tools.jamba_format import TAG_START as LIST_START
from kvledger.engine.server.tools.k2_horizon_format import GROUP_START as K2_GROUP
from kvledger.engine.server.tools.lark_text import json_value, lark, rule
from kvledger.engine.server.tools.lfm2_format import CALL_START as LFM2_START
from kvledger.engine.server.tools.longcat_format import TAG_END as LONGCAT_END
from kvledger.engine.server.tools.longcat_format import TAG_START as LONGCAT_START
from kvledger.engine.server.tools.param_grammars import PARAM_GRAMMARS as _BY_PARAMETER
from kvledger.engine.server.tools.parsers import PARSERS, CallScanner
from kvledger.engine.server.tools.phi4_format import FUNCTOOLS
from kvledger.engine.server.tools.protocol import NamedToolChoice, Tool
from kvledger.engine.server.tools.python_grammar import PYTHON_GRAMMARS
from kvledger.engine.server.tools.pythonic_format import FUNCTION_CALLS
from kvledger.engine.server.tools.step3_format import CALLS_BEGIN as STEP3_CALLS_BEGIN
from kvledger.engine.server.tools.step3_grammar import step3_calls_grammar
from kvledger.engine.server.validation import Refusal

PARAM_GRAMMARS = {**_BY_PARAMETER, **PYTHON_GRAMMARS, "step3": step3_calls_grammar}
AUTO_NEEDS_FLAGS = ("\"auto\" tool choice requires --enable-auto-tool-choice and "
                    "--tool-call-parser to be set")


@dataclass(frozen=True)
class CallFormat:
    """How calls are written: ``opening``, then each call as ``head`` + the name (a JSON
    string when ``quoted``) + ``after_name`` + ARGS + ``tail``, several joined by
    ``separator``, then ``closing``. ``counter``: Lark written between the name and
    ``after_name`` (Kimi's ``:N``)."""

    opening: str
    head: str
    after_name: str
    tail: str
    separator: str
    closing: str = ""
    quoted: bool = True
    counter: str = ""


_JSON_HEAD = '{"name": '
_HERMES = CallFormat("", "<tool_call>\n" + _JSON_HEAD, ', "arguments": ', "}\n</tool_call>", "\n")
_LLAMA_JSON = CallFormat("", _JSON_HEAD, ', "parameters": ', "}", "; ")
_TAGGED_LIST = CallFormat(LIST_START + "[", _JSON_HEAD, ', "arguments": ', "}", ", ",
                          "]" + LIST_END)
FORMATS = {
    "hermes": _HERMES, "qwen3_json": _HERMES,
    "llama3_json": _LLAMA_JSON, "llama4_json": _LLAMA_JSON,
    # Mistral's tokenizers before v11: [TOOL_CALLS] and a JSON array of the calls.
    "mistral": CallFormat("[TOOL_CALLS][", _JSON_HEAD, ', "arguments": ', "}", ", ", "]"),
    # DeepSeek's templates' layouts (their arguments on one line: vLLM's patterns ask it).
    "deepseek_v3": CallFormat(CALLS_BEGIN, CALL_BEGIN + "function" + SEP, V3_ARGUMENTS,
                              V3_CLOSE + CALL_END, "\n", CALLS_END, quoted=False),
    "deepseek_v31": CallFormat(CALLS_BEGIN, CALL_BEGIN, SEP, CALL_END, "", CALLS_END,
                               quoted=False),
    # Kimi's template: each call's id, functions.NAME:N (N counts the chat's calls).
    "kimi_k2": CallFormat(kimi.SECTION_BEGIN, kimi.CALL_BEGIN + "functions.",
                          kimi.ARGUMENT_BEGIN, kimi.CALL_END, "", kimi.SECTION_END,
                          quoted=False, counter='":" /[0-9]{1,4}/'),
    # xLAM's: the whole answer a JSON list of the calls.
    "xlam": CallFormat("[", _JSON_HEAD, ', "arguments": ', "}", ", ", "]"),
    # Jamba's and Hunyuan-A13B's: the JSON list in <tool_calls> tags.
    "jamba": _TAGGED_LIST, "hunyuan_a13b": _TAGGED_LIST,
    # InternLM's template: each call after its markers, one after another.
    "internlm": CallFormat("", CALL_START + "\n" + _JSON_HEAD, ', "arguments": ',
                           "}" + ACTION_END, ""),
    "longcat": CallFormat("", LONGCAT_START + "\n" + _JSON_HEAD, ', "arguments": ',
                          "}\n" + LONGCAT_END, "\n"),
    "granite": CallFormat(GRANITE_TOOL_TOKEN + "[", _JSON_HEAD, ', "arguments": ', "}", ", ", "]"),
    "granite4": _HERMES,  # (Granite 4's template writes hermes' layout)
    "granite-20b-fc": CallFormat("", FUNCTION_CALL + " " + _JSON_HEAD, ', "arguments": ', "}",
                                 ""),
    "phi4_mini_json": CallFormat(FUNCTOOLS, _JSON_HEAD, ', "arguments": ', "}", ", ", "]"),
}
# v11 and later (a tokenizer with the [ARGS] token): [TOOL_CALLS]name[ARGS]{...} each.
MISTRAL_V11 = CallFormat("", "[TOOL_CALLS]", "[ARGS]", "", "", quoted=False)
assert set(FORMATS) | set(PARAM_GRAMMARS) == set(PARSERS)


@dataclass(frozen=True)
class ToolPlan:
    """What serving one request's tools takes: the parser that reads calls back (None:
    the answer is text), the Lark grammar that constrains the output (None: free), and
    the special tokens the parser must see in the text."""

    parser: str | None
    grammar: str | None
    max_calls: int | None
    kept_ids: frozenset[int] = frozenset()
    named: bool = False  # the request named the function (its answer finishes "stop")
    tools: tuple[Tool, ...] = ()  # whose schemas type the values of qwen3_coder's calls

    def scanner(self) -> CallScanner | None:
        return None if self.parser is None else \
            CallScanner(self.parser, self.max_calls, self.tools)


NO_TOOLS = ToolPlan(None, None, None)


def template_parser(chat_template: str | None) -> str:
    """The call format a chat template shows; hermes when it shows none."""
    template = chat_template or ""
    if kimi.SECTION_BEGIN in template:
        return "kimi_k2"
    if "<tool_call>" in template and "<arg_key>" in template:
        return "glm45"
    if "<minimax:tool_call>" in template:
        return "minimax_m2"
    if GRANITE_TOOL_TOKEN in template:
        return "granite"
    if "<tool_call>" in template and "<|start_of_role|>" in template:  # Granite 4's roles
        return "granite4"
    if FUNCTION_CALL in template:
        return "granite-20b-fc"
    if FUNCTOOLS in template:
        return "phi4_mini_json"
    if STEP3_CALLS_BEGIN in template:
        return "step3"
    if CALL_START in template:
        return "internlm"
    if LONGCAT_START in template:
        return "longcat"
    if LIST_START in template:  # Hunyuan's asks an answer without calls to begin 助手：
        return "hunyuan_a13b" if HUNYUAN_REPLY in template else "jamba"
    if CALLS_BEGIN in template:  # DeepSeek's: V3's wraps the arguments in ```json
        return "deepseek_v3" if "```json" in template else "deepseek_v31"
    if "<function=" in template and "<parameter=" in template:
        return "seed_oss" if "<seed:tool_call>" in template else "qwen3_coder"
    if FUNCTION_CALLS in template:
        return "olmo3"
    if LFM2_START in template:
        return "lfm2"
    if K2_GROUP in template:
        return "k2_horizon"
    if "<tool_call>" not in template and "[TOOL_CALLS]" in template:
        return "mistral"
    if "<tool_call>" not in template and "<|python_tag|>" in template:
        return "llama3_json"
    return "hermes"


def control_token_ids(tokenizer) -> dict[str, int]:
    """Each format's markers that ``tokenizer`` holds as one token of their own, with their
    ids: special tokens, and added tokens that are not special (Qwen2.5's and Hermes'
    ``<tool_call>``). The grammar names them as those tokens (a grammar library takes
    every added token for a special one, which a string literal may never produce); plain
    constrained text still never does."""
    markers = {m for ms in CONTROL_TOKENS.values() for m in ms}
    ids = {m: tokenizer.special_token_id(m) or tokenizer.added_token_id(m)
           for m in sorted(markers)}
    return {m: i for m, i in ids.items() if i is not None}


def tool_plan(tools: list[Tool] | None, choice, parallel: bool, *, auto_enabled: bool,
              parser: str | None, chat_template: str | None,
              specials: dict[str, int] | None = None,
              template_kwargs: dict[str, Any] | None = None) -> ToolPlan:
    """The plan of a request whose ``choice`` is ``check_tool_choice``'s; a ``Refusal``
    (400) for ``"auto"`` on a server not started for it, and for a layout of calls the
    chat template is asked for (``template_kwargs``) that the parser does not read.
    ``specials``: the tokenizer's ``control_token_ids``."""
    if not tools or choice == "none":
        return NO_TOOLS
    specials = specials or {}
    indexed = list(enumerate(tools))
    if isinstance(choice, NamedToolChoice):  # that function, once
        indexed = [(i, t) for i, t in indexed if t.function.name == choice.function.name]
        parallel = False
    tools = [t for _, t in indexed]
    max_calls = None if parallel else 1
    if choice == "auto":
        if not (auto_enabled and parser):
            raise Refusal(AUTO_NEEDS_FLAGS, "tool_choice")
        _check_layout(parser, template_kwargs or {})
        return ToolPlan(parser, None, max_calls, _kept(parser, specials), tools=tuple(tools))
    parser = parser or template_parser(chat_template)
    _check_layout(parser, template_kwargs or {})
    if parser in PARAM_GRAMMARS:
        grammar = PARAM_GRAMMARS[parser](indexed, parallel, specials)
    else:
        fmt = MISTRAL_V11 if parser == "mistral" and ARGS in specials else FORMATS[parser]
        grammar = calls_grammar(fmt, tools, parallel, specials)
    return ToolPlan(parser, grammar, max_calls, _kept(parser, specials),
                    named=isinstance(choice, NamedToolChoice), tools=tuple(tools))


def _check_layout(parser: str, template_kwargs: dict[str, Any]) -> None:
    """K2 Horizon's template writes calls in the layout ``tool_call_format`` names (xml,
    its default; json; xml_typed): kvledger reads and writes xml alone."""
    layout = template_kwargs.get("tool_call_format", "xml")
    if parser == "k2_horizon" and layout != "xml":
        raise Refusal(f"'chat_template_kwargs.tool_call_format' {layout!r}: kvledger reads "
                      f"k2_horizon's calls in its 'xml' layout only", "chat_template_kwargs")


def _kept(parser: str, specials: dict[str, int]) -> frozenset[int]:
    return frozenset(specials[m] for m in CONTROL_TOKENS[parser] if m in specials)


def calls_grammar(fmt: CallFormat, tools: list[Tool], parallel: bool,
                  specials: dict[str, int] | None = None) -> str:
    """A Lark grammar (llguidance's dialect) of one call, or one or more, to ``tools``:
    the wrapper and the name are literals (``specials``, the tokenizer's special tokens
    among them, as those tokens), the arguments ``%json`` of the schema."""
    specials = specials or {}
    text = functools.partial(lark, specials=specials)
    more = f"({rule(text(fmt.separator), 'call')})*" if parallel else ""
    lines = ["start: " + rule(text(fmt.opening), "call", more, text(fmt.closing))]
    alternatives = []
    for i, tool in enumerate(tools):
        name = tool.function.name
        head = fmt.head + (json.dumps(name) if fmt.quoted else name)
        head = rule(text(head), fmt.counter, text(fmt.after_name)) if fmt.counter else \
            text(head + fmt.after_name)
        alternatives.append(f"call_{i}")
        lines.append(f"call_{i}: " + rule(head, f"args_{i}", text(fmt.tail)))
        lines.append(f"args_{i}: " + json_value(tool.function.schema))
    lines.insert(1, "call: " + " | ".join(alternatives))
    return "\n".join(lines) + "\n"


def schema_problem(tools: list[Tool]) -> str | None:
    """The first declared function whose schema the grammar library refuses, with its
    reason, or None (called once a tool grammar failed to compile, to name the culprit)."""
    from llguidance import LLMatcher

    for i, tool in enumerate(tools):
        try:
            source = LLMatcher.grammar_from_json_schema(tool.function.schema)
        except ValueError as exc:
            error = str(exc)
        else:
            error = LLMatcher.validate_grammar(source)
        if error:
            return (f"'tools[{i}].function.parameters' ({tool.function.name}): the schema "
                    f"cannot be compiled: {' '.join(error.split())[:200]}")
    return None
