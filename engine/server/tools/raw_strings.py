"""A string parameter written bare, as qwen3_coder writes one (``<parameter=city>\\nParis
\\n</parameter>``), constrained to its schema: llguidance lexemes (regexes in its Lark
dialect) of the text that, read back as vLLM reads it, is a value the schema accepts.

The schemas read: ``type`` string (or string and null), ``enum``/``const``, ``pattern``
(JSON Schema's search: ``^``/``$`` at its ends are anchors), ``minLength``/``maxLength``,
``anyOf``/``oneOf`` of such branches (a null branch: nothing to write), and the keywords
that only describe. Any other (``format``, ``$ref``...) is refused: the grammar could not
promise the value. The text never holds what would end the value early when read back:
a ``</parameter>`` or ``<parameter=`` tag (spaces inside them too, as vLLM reads them)
or ``</function>``.
"""

from __future__ import annotations

from typing import Any

from kvledger.engine.server.tools.lark_text import rule

ANY_TEXT = "(?s:.*)"
# What would end a value before its own closing tag, as vLLM's reading finds them:
# qwen3_coder's (the default), GLM's, K2 Horizon's, MiniMax-M2's (its reader's pattern, and the marker
# that ends a call wherever it is).
XML_ENDS = r"<\s*\/\s*parameter\s*>|<\s*parameter\s*=|<\/function>"
GLM_ENDS = r"<\/arg_value>|<\/tool_call>"
K2_ENDS = r"<\/ifm\|arg_value>|<\/ifm\|tool_call>|<\/ifm\|tool_calls>"
MINIMAX_ENDS = r"<\s*\/\s*parameter\s*>|<\s*parameter\s+name\s*=|<\/invoke>"
_DESCRIBING = frozenset({"title", "description", "default", "examples", "$comment",
                         "deprecated", "readOnly", "writeOnly"})
_STRING_KEYS = _DESCRIBING | {"type", "enum", "const", "pattern", "minLength", "maxLength"}
_STRING_TYPES = ("string", ["string"], ["string", "null"], ["null", "string"])
_META = frozenset("\\^$.|?*+()[]{}/-&~#")


class Unsupported(ValueError):
    """What of a schema this grammar cannot constrain a bare string to."""


def string_branches(schema: Any) -> list[list[str]]:
    """The values ``schema`` accepts as bare text: alternatives, each the regexes that
    all must match it (llguidance's ``&``)."""
    if schema is True or schema == {}:
        return [[ANY_TEXT]]
    if not isinstance(schema, dict):
        raise Unsupported(f"the schema {schema!r}")
    if "anyOf" in schema or "oneOf" in schema:
        key = "anyOf" if "anyOf" in schema else "oneOf"
        extra = set(schema) - _DESCRIBING - {key}
        if extra or not isinstance(schema[key], list):
            raise Unsupported(f"{key!r} beside {sorted(extra)}" if extra else repr(key))
        branches = [b for b in schema[key] if not _null_only(b)]
        if not branches:
            raise Unsupported(f"{key!r} without a string")
        return [regexes for b in branches for regexes in string_branches(b)]
    extra = sorted(set(schema) - _STRING_KEYS)
    if extra:
        raise Unsupported(repr(extra[0]))
    if "type" in schema and schema["type"] not in _STRING_TYPES:
        raise Unsupported(f"'type' {schema['type']!r}")
    if "enum" in schema or "const" in schema:
        return [[_literals(schema)]]
    regexes = [ANY_TEXT]
    pattern = schema.get("pattern")
    if pattern is not None:
        if not isinstance(pattern, str):
            raise Unsupported("'pattern'")
        regexes.append(_searched(pattern))
    low, high = schema.get("minLength", 0), schema.get("maxLength")
    if not isinstance(low, int) or not (high is None or isinstance(high, int)):
        raise Unsupported("'minLength'/'maxLength'")
    if low or high is not None:
        regexes.append(f"(?s:.){{{low},{'' if high is None else high}}}")
    return [regexes]


def _null_only(schema: Any) -> bool:
    return isinstance(schema, dict) and schema.get("type") == "null" and \
        not set(schema) - _DESCRIBING - {"type"}


def _literals(schema: dict[str, Any]) -> str:
    values = schema["enum"] if "enum" in schema else [schema["const"]]
    if not isinstance(values, list) or not values:
        raise Unsupported("'enum'")
    texts = []
    for value in values:
        if value is None:
            texts.append("null")  # read back as null, which the schema allows
        elif isinstance(value, str):
            texts.append(value)
        else:
            raise Unsupported(f"the value {value!r} in 'enum'")
    return "|".join(escape(t) for t in texts)


def escape(text: str) -> str:
    """``text`` matched literally in a llguidance regex (inside ``/.../``)."""
    return "".join("\\" + c if c in _META else c if c.isprintable() else f"\\x{{{ord(c):x}}}"
                   for c in text)


def _searched(pattern: str) -> str:
    """A JSON Schema pattern (a search) as a regex of the whole value."""
    start = pattern.startswith("^")
    body = pattern[1:] if start else pattern
    end = body.endswith("$") and not body.endswith("\\$")
    body = _slashes_escaped(body[:-1] if end else body)
    return ("" if start else ANY_TEXT) + f"(?:{body})" + ("" if end else ANY_TEXT)


def _slashes_escaped(regex: str) -> str:
    """``/`` ends a regex in llguidance's Lark: each unescaped one escaped."""
    out, escaped = [], False
    for char in regex:
        out.append("\\/" if char == "/" and not escaped else char)
        escaped = char == "\\" and not escaped
    return "".join(out)


def lexemes(name: str, schema: Any, ends: str = XML_ENDS,
            close: str = '"\\n</parameter>"') -> tuple[str, list[str]]:
    """The token ``name`` of a bare value of ``schema`` and its closing tag (``close``, a
    Lark sequence of text: "" when the caller writes it), and the lines defining it and its alternatives; the value never holds
    a match of ``ends`` (a regex of what would end it early)."""
    not_ending = f"~/{ANY_TEXT}(?:{ends}){ANY_TEXT}/"
    lines, options = [], []
    for j, regexes in enumerate(string_branches(schema)):
        option = f"{name}_{j}"
        options.append(option)
        lines.append(f"{option}: " + " & ".join(f"/{r}/" for r in regexes) + f" & {not_ending}")
    return name, [rule(f'{name}: ({" | ".join(options)})', close), *lines]
