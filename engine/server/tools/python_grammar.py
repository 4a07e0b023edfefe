"""The grammar of ``tool_choice: "required"`` and a named function for the formats whose
calls are Python calls with keyword arguments (``PythonLayout``): pythonic
(``llama4_pythonic``) ``[NAME(KEY=VALUE, ...), ...]``; olmo3 the same calls one a line in
``<function_calls>\\n``...``\\n</function_calls>`` (OLMo 3's layout); lfm2 pythonic's
list in ``<|tool_call_start|>``...``<|tool_call_end|>``. Each declared parameter in turn
(``param_grammars``' order and refusals), its value ``%json`` of its schema: read back as
a Python literal (``true``, ``false`` and ``null`` too), the JSON it is.
"""

from __future__ import annotations

import functools
import keyword
import re
from dataclasses import dataclass

from kvledger.engine.server.tools.lark_text import json_value, lark, rule
from kvledger.engine.server.tools.param_grammars import Tools, _dict, _in_order, _parameters
from kvledger.engine.server.validation import Refusal

_PYTHON_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]*")


@dataclass(frozen=True)
class PythonLayout:
    """How one format writes Python calls: the text before, between and after them."""

    opening: str
    between: str
    closing: str


PYTHONIC = PythonLayout("[", ", ", "]")
OLMO3 = PythonLayout("<function_calls>\n", "\n", "\n</function_calls>")
LFM2 = PythonLayout("<|tool_call_start|>[", ", ", "]<|tool_call_end|>")


def pythonic_calls_grammar(tools: Tools, parallel: bool, specials: dict[str, int],
                           layout: PythonLayout = PYTHONIC) -> str:
    text = functools.partial(lark, specials=specials)
    lines = ["start: " + rule(text(layout.opening), "call",
                              f"({text(layout.between)} call)*" if parallel else "",
                              text(layout.closing))]
    for n, (i, tool) in enumerate(tools):
        name = tool.function.name
        if not _python_name(name):
            raise Refusal(f"'tools[{i}].function.name' {name!r}: a pythonic call's name is a "
                          f"Python name (a letter, then letters, digits or '_')", "tools")
        params, defs = _parameters(tool, i, "pythonic", _python_key)
        items = []
        for k, (key, schema, required) in enumerate(params):
            items.append((f"p_{n}_{k}", required))
            lines += [f'p_{n}_{k}: "{key}=" v_{n}_{k}',
                      f"v_{n}_{k}: " + json_value({**defs, **_dict(schema)})]
        body, more = _in_order(f"a_{n}", items, '", "')
        lines += [f'call_{n}: "{name}(" ' + rule(body, '")"'), *more]
    lines.insert(1, "call: " + " | ".join(f"call_{n}" for n in range(len(tools))))
    return "\n".join(lines) + "\n"


PYTHON_GRAMMARS = {
    "pythonic": pythonic_calls_grammar, "llama4_pythonic": pythonic_calls_grammar,
    "olmo3": functools.partial(pythonic_calls_grammar, layout=OLMO3),
    "lfm2": functools.partial(pythonic_calls_grammar, layout=LFM2)}


def _python_key(key: str) -> str | None:
    if not _python_name(key):
        return "a pythonic call's keyword argument is a Python name (not a keyword)"
    return None


def _python_name(name: str) -> bool:
    return bool(_PYTHON_NAME.fullmatch(name)) and not keyword.iskeyword(name)
