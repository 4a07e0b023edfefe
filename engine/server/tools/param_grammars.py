"""The grammars of ``tool_choice: "required"`` and a named function for the formats that
write a call's arguments one by one rather than as a JSON object:

- qwen3_coder (``qwen3_xml``): ``<tool_call>\\n<function=NAME>\\n``, each parameter as
  ``<parameter=KEY>\\nVALUE\\n</parameter>\\n``, ``</function>\\n</tool_call>``; several
  calls apart by a newline (Qwen3-Coder's chat template's layout); seed_oss the same in
  ``<seed:tool_call>``;
- glm45 (``glm47``): ``<tool_call>NAME\\n``, each parameter as
  ``<arg_key>KEY</arg_key>\\n<arg_value>VALUE</arg_value>\\n``, ``</tool_call>``; several
  calls apart by a newline (GLM-4.5's chat template's layout); poolside_v1 the same, its
  strings bare only where the schema's ``type`` is ``"string"``; k2_horizon:
  ``<ifm|tool_calls>``, calls apart by a newline, each ``<ifm|tool_call>NAME`` and its
  ``<ifm|arg_key>KEY</ifm|arg_key><ifm|arg_value>VALUE</ifm|arg_value>``, then
  ``</ifm|tool_calls>`` (vLLM's tests' layout);
- minimax_m2: ``<minimax:tool_call>\\n``, each call as ``<invoke name="NAME">\\n``, each
  parameter as ``<parameter name="KEY">VALUE</parameter>\\n``, ``</invoke>\\n``, then
  ``</minimax:tool_call>`` (MiniMax-M2's chat template's layout);
- step3: ``step3_grammar``'s layout of the same builder (``calls_grammar``);
- pythonic, olmo3 and lfm2: ``python_grammar``'s, given the same parameters in turn.

The first five are one builder (``calls_grammar``) given each format's ``ParamLayout``.
Each declared property in the schema's order, the required ones always, the others when
the model chooses; no other key. A value is ``%json`` of its property's schema, except
qwen3_coder's, GLM's, K2 Horizon's and MiniMax's strings, written bare (``raw_strings``).
Read back as vLLM reads these formats (a string parameter stays the text written, others
take their schema's type), the arguments are valid against the schema. What the format
cannot write so, a schema or a name, is a 400 naming it.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvledger.engine.server.tools.lark_text import json_value, lark, rule
from kvledger.engine.server.tools.protocol import Tool
from kvledger.engine.server.tools.raw_strings import (
    GLM_ENDS,
    K2_ENDS,
    MINIMAX_ENDS,
    Unsupported,
    lexemes,
)
from kvledger.engine.server.tools.schema_types import schema_types
from kvledger.engine.server.tools.xml_format import QWEN3, SEED, XmlTags
from kvledger.engine.server.validation import Refusal

_DESCRIBING = frozenset({"title", "description", "default", "examples", "$comment",
                         "$schema", "$id", "strict", "deprecated"})
_OBJECT_KEYS = _DESCRIBING | {"type", "properties", "required", "additionalProperties",
                              "$defs", "definitions"}

Tools = list[tuple[int, Tool]]  # each with its place in the request's 'tools'


@dataclass(frozen=True)
class ParamLayout:
    """How one format writes a call with its parameters one by one: the text around the
    calls (``calls``: opening and closing; None: none) and between them, around each
    call (``{name}`` in ``call_open``) and each parameter (``{key}`` in ``param_open``),
    and its values: ``value`` (token, schema, where) -> (expression, rules) when the
    format types them itself, else a string bare (``raw_strings.lexemes`` with
    ``string_ends``; followed by ``string_close`` where its token does not end it) and any
    other ``%json`` of its schema (``bare``: which schemas' strings are written bare).
    ``key_problem`` says why a name cannot be written."""

    fmt: str
    key_problem: Callable[[str], str | None]
    call_open: str
    call_close: str
    param_open: str
    param_close: str
    calls: tuple[str, str] | None = None
    between: str = "\n"
    string_ends: tuple[str, ...] = ()
    string_close: str | None = None
    value: Callable[[str, Any, str], tuple[str, list[str]]] | None = None
    bare: Callable[[Any], bool] = lambda schema: "string" in schema_types(schema)

    def written(self, token: str, schema: Any, where: str, defs: dict[str, Any]
                ) -> tuple[str, list[str], str]:
        """A parameter's value: its expression, the rules it needs, and its closing text."""
        if self.value is not None:
            return (*self.value(token, schema, where), self.param_close)
        if self.bare(schema):
            value, rules = _bare_string(token, schema, where, self.fmt, *self.string_ends)
            return value, rules, (self.param_close if self.string_close is None
                                  else self.string_close)
        name = token.lower()  # a rule, not a token: %json is no lexeme
        return name, [f"{name}: " + json_value({**defs, **_dict(schema)})], self.param_close


def calls_grammar(layout: ParamLayout, tools: Tools, parallel: bool,
                  specials: dict[str, int]) -> str:
    """The grammar of calls to ``tools`` (one, or ``parallel`` several) as ``layout``
    writes them; a ``Refusal`` for what it cannot write."""
    text = functools.partial(lark, specials=specials)
    more = f"({rule(text(layout.between), 'call')})*" if parallel else ""
    opening, closing = layout.calls or ("", "")
    lines = ["start: " + rule(text(opening), "call", more, text(closing))]
    for n, (i, tool) in enumerate(tools):
        name = tool.function.name
        params, defs = _parameters(tool, i, layout.fmt, layout.key_problem)
        items = []
        for k, (key, schema, required) in enumerate(params):
            items.append((f"p_{n}_{k}", required))
            value, rules, close = layout.written(f"V_{n}_{k}", schema, _where(i, name, key),
                                                 defs)
            lines += [f"p_{n}_{k}: " + rule(text(layout.param_open.format(key=key)), value,
                                            text(close)), *rules]
        body, more = _in_order(f"a_{n}", items, "")
        lines += [f"call_{n}: " + rule(text(layout.call_open.format(name=name)), body,
                                       text(layout.call_close)), *more]
    lines.insert(1, "call: " + " | ".join(f"call_{n}" for n in range(len(tools))))
    return "\n".join(lines) + "\n"


def _xml_key(key: str) -> str | None:
    if not key or key[0].isspace() or "<" in key or ">" in key:
        return "a qwen3_coder parameter's name has no '<' or '>' and does not begin blank"
    return None


def _tag_key(fmt: str) -> Callable[[str], str | None]:
    """Why a name cannot be ``fmt``'s key between tags (read back stripped), or None."""
    return lambda key: (f"a {fmt} parameter's name has no '<' or '>' and neither begins nor "
                        f"ends blank") if not key or key != key.strip() or "<" in key \
        or ">" in key else None


def _minimax_key(key: str) -> str | None:
    if not key or key != key.strip() or any(c in key for c in "<>\"'"):
        return ("a minimax_m2 parameter's name has no '<', '>' or quote and neither begins "
                "nor ends blank")
    return None


def _xml_layout(tags: XmlTags) -> ParamLayout:
    # A string's token holds its closing '\n</parameter>' (lexemes' default ending).
    return ParamLayout("qwen3_coder", _xml_key, tags.tool_start + "\n<function={name}>\n",
                       "</function>\n" + tags.tool_end, "<parameter={key}>\n",
                       "\n</parameter>\n", string_close="\n")


XML = _xml_layout(QWEN3)
GLM = ParamLayout("glm45", _tag_key("glm45"), "<tool_call>{name}\n", "</tool_call>",
                  "<arg_key>{key}</arg_key>\n<arg_value>", "</arg_value>\n",
                  string_ends=(GLM_ENDS, ""))
# vLLM's poolside_v1 keeps a value as written only where the schema's type is "string".
POOLSIDE = dataclasses.replace(
    GLM, fmt="poolside_v1", key_problem=_tag_key("poolside_v1"),
    bare=lambda schema: isinstance(schema, dict) and schema.get("type") == "string")
K2_HORIZON = ParamLayout(
    "k2_horizon", _tag_key("k2_horizon"), "<ifm|tool_call>{name}", "</ifm|tool_call>",
    "<ifm|arg_key>{key}</ifm|arg_key><ifm|arg_value>", "</ifm|arg_value>",
    calls=("<ifm|tool_calls>", "</ifm|tool_calls>"), string_ends=(K2_ENDS, ""))
MINIMAX = ParamLayout("minimax_m2", _minimax_key, '<invoke name="{name}">\n', "</invoke>\n",
                      '<parameter name="{key}">', "</parameter>\n",
                      calls=("<minimax:tool_call>\n", "</minimax:tool_call>"), between="",
                      string_ends=(MINIMAX_ENDS, ""))


PARAM_GRAMMARS = {
    "qwen3_coder": functools.partial(calls_grammar, XML),
    "qwen3_xml": functools.partial(calls_grammar, XML),
    "seed_oss": functools.partial(calls_grammar, _xml_layout(SEED)),
    "glm45": functools.partial(calls_grammar, GLM), "glm47": functools.partial(calls_grammar, GLM),
    "poolside_v1": functools.partial(calls_grammar, POOLSIDE),
    "k2_horizon": functools.partial(calls_grammar, K2_HORIZON),
    "minimax_m2": functools.partial(calls_grammar, MINIMAX),
}


def _parameters(tool: Tool, i: int, fmt: str, key_problem
                ) -> tuple[list[tuple[str, Any, bool]], dict[str, Any]]:
    """The declared properties in order (key, schema, required) and the definitions
    their schemas may refer to; a ``Refusal`` for what the format cannot write."""
    schema, name = tool.function.schema, tool.function.name
    where = f"'tools[{i}].function.parameters' ({name})"
    extra = sorted(set(schema) - _OBJECT_KEYS)
    if extra or schema.get("type", "object") not in ("object", ["object"]):
        what = repr(extra[0]) if extra else f"'type' {schema['type']!r}"
        raise Refusal(f"{where}: a {fmt} call writes each declared property in turn, which "
                      f"cannot honour {what}", "tools")
    properties, required = schema.get("properties", {}), schema.get("required", [])
    if not isinstance(properties, dict) or not isinstance(required, list):
        raise Refusal(f"{where}: 'properties' is an object and 'required' a list", "tools")
    missing = [r for r in required if r not in properties]
    if missing:
        raise Refusal(f"{where}: 'required' names {missing[0]!r}, which 'properties' does "
                      f"not declare", "tools")
    for key in properties:
        problem = key_problem(key)
        if problem:
            raise Refusal(f"{_where(i, name, key)}: {problem}", "tools")
    defs = {k: schema[k] for k in ("$defs", "definitions") if k in schema}
    return [(k, s, k in required) for k, s in properties.items()], defs


def _where(i: int, name: str, key: str) -> str:
    return f"'tools[{i}].function.parameters.properties.{key}' ({name})"


def _dict(schema: Any) -> dict[str, Any]:
    return schema if isinstance(schema, dict) else {"allOf": [schema]}


def _bare_string(token: str, schema: Any, where: str, fmt: str,
                 *ending: str) -> tuple[str, list[str]]:
    """The token of a string parameter's bare value (and its closing tag: ``ending``,
    the format's ``lexemes`` ends and close, qwen3_coder's when none)."""
    types = schema_types(schema)
    try:
        if types - {"string", "null"}:
            raise Unsupported(f"a string beside {sorted(types - {'string', 'null'})}")
        return lexemes(token, schema, *ending)
    except Unsupported as exc:
        raise Refusal(f"{where}: a {fmt} string is written bare, constrained by "
                      f"type, enum, const, pattern, minLength, maxLength and anyOf/oneOf "
                      f"of those; not by {exc}", "tools") from None


def _in_order(prefix: str, items: list[tuple[str, bool]], separator: str
              ) -> tuple[str, list[str]]:
    """``items`` in order, each optional one given or not, joined by ``separator`` (a
    Lark literal, or ""): the expression and the rules it needs."""
    if not separator:
        return " ".join(item if required else f"({item})?" for item, required in items), []
    lines, n = [], len(items)
    for k in reversed(range(n)):
        item, required = items[k]
        rest = f" {prefix}_rest_{k + 1}" if k + 1 < n else ""
        if k:  # the params after one given, each after the separator
            lines.append(f"{prefix}_rest_{k}: " + (f"{separator} {item}{rest}" if required
                                                     else f"({separator} {item})?{rest}"))
        first = f"{item}{rest}"
        if required:
            lines.append(f"{prefix}_first_{k}: {first}")
        elif k + 1 < n:
            lines.append(f"{prefix}_first_{k}: {first} | {prefix}_first_{k + 1}")
        else:
            lines.append(f"{prefix}_first_{k}: ({first})?")
    return (f"{prefix}_first_0" if n else ""), lines
