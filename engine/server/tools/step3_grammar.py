"""The grammar of ``tool_choice: "required"`` and a named function for step3 (Step-3),
``param_grammars.calls_grammar`` in Step-3's layout (``STEP3``):

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
from kvledger.engine.server.tools.lark_text import json_value
from kvledger.engine.server.tools.param_grammars import (
    ParamLayout,
    _bare_string,
    calls_grammar,
)
from kvledger.engine.server.validation import Refusal

_UNPADDED = r"(?:[^\s<](?:[^<]*[^\s<])?)?"


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


STEP3 = ParamLayout("step3", _step3_key,
                    step3.CALL_BEGIN + "function" + step3.SEP + step3.INVOKE + '{name}">',
                    "</steptml:invoke>" + step3.CALL_END, step3.PARAMETER + '{key}">',
                    step3.PARAMETER_END, calls=(step3.CALLS_BEGIN, step3.CALLS_END),
                    value=_step3_value)
step3_calls_grammar = functools.partial(calls_grammar, STEP3)
