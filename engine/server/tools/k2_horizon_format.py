"""k2_horizon (K2 Horizon): GLM's key/value calls in IFM's tags, all in one group::

    <ifm|tool_calls><ifm|tool_call>get_weather<ifm|arg_key>city</ifm|arg_key>
    <ifm|arg_value>Paris</ifm|arg_value></ifm|tool_call></ifm|tool_calls>

Read as vLLM 0.32's ``K2HorizonToolParser`` reads a whole answer in its default layout
(``xml``; a request asking another through ``chat_template_kwargs.tool_call_format`` is
refused, ``calls.tool_plan``): the group runs from the first ``<ifm|tool_calls>`` to the
first ``</ifm|tool_calls>`` after it, and holds nothing but calls (and blanks), each from
``<ifm|tool_call>`` to its closing tag. A call's name is its text up to its first
``<ifm|arg_key>``, stripped: no blank inside, one of the request's tools (any, when it
declares none). Then nothing but pairs (and blanks), found as glm45's are
(``glm_format.pair_at`` with IFM's tags), a type tag refused, each key stripped, none
empty or given twice; each value typed by the schema (``schema_types.coerce``: a string
as written, another type stripped first). Anything else, anywhere in the group, makes
the whole answer content; else the calls are made and the content is the text around
the group.

The stream sends the content before the group as it comes, the calls (or the group as
content) once the group ends, and the text after it as content.
"""

from __future__ import annotations

import json

from kvledger.engine.server.tools.call_pieces import Piece, content_until, whole_calls
from kvledger.engine.server.tools.glm_format import PairTags, pair_at
from kvledger.engine.server.tools.pythonic_format import REGEX_SPACES
from kvledger.engine.server.tools.schema_types import coerce, schema_types

GROUP_START, GROUP_END = "<ifm|tool_calls>", "</ifm|tool_calls>"
CALL_START, CALL_END = "<ifm|tool_call>", "</ifm|tool_call>"
PAIRS = PairTags("<ifm|arg_key>", "</ifm|arg_key>", "<ifm|arg_value>", "</ifm|arg_value>",
                 "<ifm|arg_type>", "</ifm|arg_type>")
_PAIR_TAGS = (PAIRS.key_start, PAIRS.key_end, PAIRS.type_start, PAIRS.type_end,
              PAIRS.value_start, PAIRS.value_end)
MARKERS = (GROUP_START, GROUP_END, CALL_START, CALL_END, *_PAIR_TAGS)


class _Malformed(ValueError):
    """What makes vLLM's reading of the group fail: the whole answer is content."""


def k2_horizon(scanner, text: str, final: bool) -> list[Piece]:
    out: list[Piece] = []
    if scanner.mode == "start":
        scanner.mode = "content"
    if scanner.mode == "content":
        if content_until(scanner, text, (GROUP_START,), final, out) is None:
            return out
        scanner.mode = "group"
    if scanner.mode == "group":
        end = scanner.find(text, GROUP_END, scanner.pos + len(GROUP_START))
        if end < 0:  # never closed: content, at the end
            if final:
                out.append(text[scanner.pos:])
                scanner.pos = len(text)
            return out
        stop = end + len(GROUP_END)
        try:
            out += whole_calls(scanner, _group(scanner, text[scanner.pos + len(GROUP_START):end]))
        except _Malformed:
            out.append(text[scanner.pos:stop])
        scanner.pos, scanner.mode = stop, "after"
    if scanner.pos < len(text):  # after the group: all content
        out.append(text[scanner.pos:])
        scanner.pos = len(text)
    return out


def _group(scanner, body: str) -> list[tuple[str, str]]:
    """The calls of a group's text: one or more, apart by blanks alone."""
    calls, pos = [], 0
    while (pos := _blanks_end(body, pos)) < len(body):
        end = body.find(CALL_END, pos + len(CALL_START))
        if not body.startswith(CALL_START, pos) or end < 0:
            raise _Malformed
        calls.append(_call(scanner, body[pos + len(CALL_START):end]))
        pos = end + len(CALL_END)
    if not calls:
        raise _Malformed
    return calls


def _call(scanner, body: str) -> tuple[str, str]:
    """A call's name and JSON arguments from its text."""
    first = body.find(PAIRS.key_start)
    if first < 0:
        if any(tag in body for tag in _PAIR_TAGS):
            raise _Malformed
        return _name(scanner, body.strip()), "{}"
    name = _name(scanner, body[:first].strip())
    properties = scanner.properties(name)
    values, pos, last = {}, first, body.rfind(PAIRS.value_end)
    while (pos := _blanks_end(body, pos)) < len(body):
        pair = pair_at(body, pos, PAIRS, REGEX_SPACES.__contains__, last) \
            if body.startswith(PAIRS.key_start, pos) else None
        if pair is None or pair[1] is not None:  # (xml's pairs have no type)
            raise _Malformed
        key, _, value, pos = pair
        key = key.strip()
        if not key or key in values:
            raise _Malformed
        types = schema_types(properties.get(key))
        values[key] = coerce(value if "string" in types else value.strip(), types)
    try:
        return name, json.dumps(values, ensure_ascii=False, allow_nan=False)
    except ValueError:
        raise _Malformed from None


def _name(scanner, name: str) -> str:
    if not name or any(c.isspace() for c in name) or not scanner.declares(name):
        raise _Malformed
    return name


def _blanks_end(text: str, at: int) -> int:
    while at < len(text) and text[at].isspace():
        at += 1
    return at
