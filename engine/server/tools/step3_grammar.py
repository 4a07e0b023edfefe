"""The grammar of ``tool_choice: "required"`` and a named function for step3 (Step-3),
built of ``param_grammars``' parts:

``<｜tool_calls_begin｜>``, each call as ``<｜tool_call_begin｜>function<｜tool_sep｜>``
``<steptml:invoke name="NAME">``, each declared parameter in turn as
``<steptml:parameter name="KEY">VALUE</steptml:parameter>``, then ``</steptml:invoke>``
``<｜tool_call_end｜>``; ``<｜tool_calls_end｜>``. A value is a string bare, never blank
at an end nor holding '<' (vLLM strips it and ends it at a '<'), else ``%json`` of a
single integer, number, boolean or null type: vLLM types no other.

Read back as vLLM's ``Step3ToolParser`` reads them, the arguments are valid against the
schema; what it cannot write so is a 400 naming it.
"""

from __future__ import annotations

import functools
from typing import Any

from kvledger.engine.server.tools import step3_format as step3
from kvledger.engine.server.tools.lark_text import json_value, lark, rule
from kvledger.engine.server.tools.param_grammars import (
    Tools,
    _bare_string,
    _in_order,
    _parameters,
    _where,
)
from kvledger.engine.server.validation import Refusal

_STEP3_HEAD = step3.CALL_BEGIN + "function" + step3.SEP
_UNPADDED = r"(?:[^\s<](?:[^<]*[^\s<])?)?"


def step3_calls_grammar(tools: Tools, parallel: bool, specials: dict[str, int]) -> str:
    text = functools.partial(lark, specials=specials)
    call = rule(text(step3.CALLS_BEGIN), "call", "call*" if parallel else "",
                text(step3.CALLS_END))
    lines = ["start: " + call]
    for n, (i, tool) in enumerate(tools):
        name = tool.function.name
        params, _ = _parameters(tool, i, "step3", _step3_key)
        items = []
        for k, (key, schema, required) in enumerate(params):
            items.append((f"p_{n}_{k}", required))
            head = text(f'{step3.PARAMETER}{key}">')
            value, definition = _step3_value(f"V_{n}_{k}", schema, _where(i, name, key))
            lines += [f"p_{n}_{k}: " + rule(head, value, text(step3.PARAMETER_END)),
                      *definition]
        body, more = _in_order(f"a_{n}", items, "")
        lines += [f"call_{n}: " + rule(text(_STEP3_HEAD + f'{step3.INVOKE}{name}">'), body,
                                       text("</steptml:invoke>" + step3.CALL_END)), *more]
    lines.insert(1, "call: " + " | ".join(f"call_{n}" for n in range(len(tools))))
    return "\n".join(lines) + "\n"


def _step3_value(token: str, schema: Any, where: str) -> tuple[str, list[str]]:
    """A step3 value as vLLM types it back: bare text with no '<', stripped (a string);
    ``%json`` of a single integer, number, boolean or null type; nothing else."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    if kind in ("integer", "number", "boolean", "null"):
        value = token.lower()  # a rule, not a token: %json is no lexeme
        return value, [f"{value}: " + json_value(schema)]
    if kind != "string":
        raise Refusal(f"{where}: vLLM's step3 parser types a value by a single 'type' of "
                      f"string, integer, number, boolean or null, so a step3 call cannot "
                      f"write one of {kind!r}", "tools")
    name, lines = _bare_string(token, schema, where, "step3", "<", "")
    # (vLLM strips the value: a string written never begins or ends blank)
    return name, [lines[0], *(f"{line} & /{_UNPADDED}/" for line in lines[1:])]


def _step3_key(key: str) -> str | None:
    return 'a step3 parameter\'s name has no \'"\'' if '"' in key else None
