"""How a chat request's ``tools`` and ``tool_choice`` are served: ``tool_plan`` decides,
once per request, which parser reads the answer back and which grammar constrains it.

- ``"none"``: the tools are in the prompt (vLLM's default), the answer is text.
- ``"auto"``: the model chooses; its text is parsed (``tool_parsers``). As in vLLM, the
  server must be started with ``--enable-auto-tool-choice`` and a parser, else a 400.
- ``"required"`` or a named function: the output is constrained by a Lark grammar
  (llguidance, compiled like any structured output) to calls in the model family's own
  format, each naming a declared function with arguments valid against its schema
  (``%json``); one call with ``parallel_tool_calls: false``, else one or more.

The format is ``--tool-call-parser``'s, else the one the model's chat template shows
(``<tool_call>``: hermes; ``<|python_tag|>``: llama3_json), else hermes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from kvledger.engine.server.tool_parsers import PARSERS, CallScanner
from kvledger.engine.server.tool_protocol import NamedToolChoice, Tool
from kvledger.engine.server.validation import Refusal

AUTO_NEEDS_FLAGS = ("\"auto\" tool choice requires --enable-auto-tool-choice and "
                    "--tool-call-parser to be set")


@dataclass(frozen=True)
class CallFormat:
    """How one call is written: ``prefix`` + ``{"name": ..., "<key>": ARGS}`` + ``suffix``,
    several joined by ``separator``."""

    prefix: str
    suffix: str
    separator: str
    arguments_key: str


FORMATS = {
    "hermes": CallFormat("<tool_call>\n", "\n</tool_call>", "\n", "arguments"),
    "llama3_json": CallFormat("", "", "; ", "parameters"),
}
assert set(FORMATS) == set(PARSERS)


@dataclass(frozen=True)
class ToolPlan:
    """What serving one request's tools takes: the parser that reads calls back (None:
    the answer is text) and the Lark grammar that constrains the output (None: free)."""

    parser: str | None
    grammar: str | None
    max_calls: int | None

    def scanner(self) -> CallScanner | None:
        return None if self.parser is None else CallScanner(self.parser, self.max_calls)


NO_TOOLS = ToolPlan(None, None, None)


def template_parser(chat_template: str | None) -> str:
    """The call format a chat template shows; hermes when it shows none."""
    if chat_template and "<|python_tag|>" in chat_template and "<tool_call>" not in chat_template:
        return "llama3_json"
    return "hermes"


def tool_plan(tools: list[Tool] | None, choice, parallel: bool, *, auto_enabled: bool,
              parser: str | None, chat_template: str | None) -> ToolPlan:
    """The plan of a request whose ``choice`` is ``check_tool_choice``'s; a ``Refusal``
    (400) for ``"auto"`` on a server not started for it."""
    if not tools or choice == "none":
        return NO_TOOLS
    max_calls = None if parallel else 1
    if choice == "auto":
        if not (auto_enabled and parser):
            raise Refusal(AUTO_NEEDS_FLAGS, "tool_choice")
        return ToolPlan(parser, None, max_calls)
    parser = parser or template_parser(chat_template)
    if isinstance(choice, NamedToolChoice):
        tools = [t for t in tools if t.function.name == choice.function.name]
    return ToolPlan(parser, calls_grammar(FORMATS[parser], tools, parallel), max_calls)


def calls_grammar(fmt: CallFormat, tools: list[Tool], parallel: bool) -> str:
    """A Lark grammar (llguidance's dialect) of one call, or one or more, to ``tools``:
    the wrapper and the name are literals, the arguments ``%json`` of the schema."""
    lines = ["start: call" + (f" ({_literal(fmt.separator)} call)*" if parallel else "")]
    alternatives = []
    for i, tool in enumerate(tools):
        head = fmt.prefix + '{"name": ' + json.dumps(tool.function.name) + \
            ', "' + fmt.arguments_key + '": '
        alternatives.append(f"call_{i}")
        lines.append(f"call_{i}: {_literal(head)} args_{i} {_literal('}' + fmt.suffix)}")
        schema = {"x-guidance": _ARGUMENTS_LAYOUT, **tool.function.schema}
        lines.append(f"args_{i}: %json " + json.dumps(schema, sort_keys=True))
    lines.insert(1, "call: " + " | ".join(alternatives))
    return "\n".join(lines) + "\n"


# The arguments laid out as json.dumps writes them: a model with weak weights cannot pad
# them with whitespace until max_tokens (llguidance allows any by default).
_ARGUMENTS_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ",
                     "key_separator": ": "}


def _literal(text: str) -> str:
    """``text`` as a Lark string literal (JSON's escapes are Lark's)."""
    return json.dumps(text)


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
