"""granite (Granite 3.0, 3.1): a JSON list of calls after ``<|tool_call|>`` (3.0's special
token) or ``<tool_call>`` (3.1's text), read as vLLM 0.32's parser engine reads a whole
answer (``GraniteParser``: its ``tool_call_body_array`` mode; ``CallScanner`` drives)::

    <|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}]

vLLM's reading, one pass forward. A marker in content is dropped and opens a list: blanks
are skipped, then a ``[`` must come, else that character is content again. In the list,
blanks and commas are skipped, a ``{`` begins an element that runs to its balanced ``}``
(counted outside strings, ``[`` with ``{``; or to the end of the answer), a ``]`` ends the
list and any other character ends it as content; later markers open lists again.

Each element is a call named by its first ``"name": "..."`` (found as vLLM's pattern finds
it, when not empty, stripped), its arguments the text of its top-level ``"arguments"``
object as written (``{}`` without one); else, or when that member is no object, the
element read as JSON gives the name and its ``arguments`` (or ``parameters``, a string as
written, else as ``json.dumps`` writes it; else the other members). A call is made when it
has a name, of any tool; where the request declares the function, its values are retyped
by the schema (``schema_types.retyped``). The content is the text before the first element
(and after the lists too when no element's pattern named it), stripped once a call is
made, none when only blank. Where vLLM's own reading fails (an element nested too deep to
read, a name that is no string) the whole answer is content.

The stream gives out the content up to the first marker as it is written (held when the
answer begins blank), and the rest at the end (``read_at_end``).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from typing import Any

from kvledger.engine.server.tools.call_json import regex_space
from kvledger.engine.server.tools.call_pieces import Piece, read_at_end
from kvledger.engine.server.tools.granite_format import next_marker
from kvledger.engine.server.tools.schema_types import retyped

TOOL_TOKEN, TOOL_STRING = "<|tool_call|>", "<tool_call>"
MARKERS = (TOOL_TOKEN, TOOL_STRING)
_BLANKS = " \t\r\n"
_NAME = '"name"'


class _Fails(Exception):
    """vLLM's own reading raises: the answer is content."""


def granite(scanner, text: str, final: bool) -> list[Piece]:
    return read_at_end(scanner, text, final, MARKERS,
                       functools.partial(read, properties=scanner.properties),
                       hold=lambda t: t[0].isspace())


def read(text: str, properties: Callable[[str], dict[str, Any]]
         ) -> tuple[str, list[tuple[str, str]]]:
    """The whole answer's content and calls, as vLLM reads them; ``properties(name)``: the
    declared function's parameter schemas."""
    before: list[str] = []
    after: list[str] = []
    elements: list[str] = []
    pos = search = 0  # where the content goes on, and where the next marker is sought
    found = dict.fromkeys(MARKERS, -2)
    while (next_ := next_marker(text, search, found)) is not None:
        at, marker = next_
        (after if elements else before).append(text[pos:at])
        pos, closed = _list(text, at + len(marker), elements)
        search = pos
        if not closed:  # a marker the list stopped at was lexed as one by vLLM: fed to
            # the list, its first character ended it, and all of it is content
            search += next((len(m) for m in MARKERS if text.startswith(m, pos)), 0)
    (after if elements else before).append(text[pos:])
    try:
        named = [_name_field(e) for e in elements]
        calls = [c for e, n in zip(elements, named, strict=True) if (c := _call(e, n, properties))]
    except _Fails:
        return text, []
    content = "".join(before) + ("" if any(named) else "".join(after))
    if elements and not content.strip():
        content = ""
    return (content.strip() if calls else content), calls


def _list(text: str, i: int, elements: list[str]) -> tuple[int, bool]:
    """Read the list a marker opened at ``i``: where the content goes on, and whether a
    ``]`` closed the list (else a character that could not be in it ended it)."""
    started = False
    while i < len(text):
        c = text[i]
        if c in _BLANKS or (started and c == ","):
            i += 1
        elif not started and c == "[":
            started, i = True, i + 1
        elif started and c == "{":
            end = _closing_brace(text, i)
            elements.append(text[i:end])
            i = end
        else:
            closed = started and c == "]"
            return i + closed, closed
    return i, False


def _closing_brace(text: str, i: int, brackets: str = "{}[]") -> int:
    """Past the ``}`` that balances the ``{`` at ``i``, counting the ``brackets`` outside
    strings (all: vLLM's list element; ``{}``: its arguments object), or the text's end."""
    depth, in_string, escaped = 0, False, False
    for j in range(i, len(text)):
        c = text[j]
        if escaped:
            escaped = False
        elif in_string:
            escaped, in_string = c == "\\", c != '"'
        elif c == '"':
            in_string = True
        elif c in brackets:
            depth = depth + 1 if c in "{[" else max(depth - 1, 0)
            if c == "}" and depth == 0:
                return j + 1
    return len(text)


def _name_field(element: str) -> str:
    """The first ``"name"\\s*:\\s*"([^"]*)"`` in the element, read forward: its value when
    not empty. (Where one candidate finds no closing quote, no later one can.)"""
    at = element.find(_NAME)
    while at >= 0:
        i = at + len(_NAME)
        while i < len(element) and regex_space(element[i]):
            i += 1
        if element.startswith(":", i):
            i += 1
            while i < len(element) and regex_space(element[i]):
                i += 1
            if element.startswith('"', i):
                end = element.find('"', i + 1)
                return "" if end < 0 else element[i + 1:end]
        at = element.find(_NAME, at + 1)
    return ""


def _call(element: str, named: str, properties) -> tuple[str, str] | None:
    name = named.strip()
    if not name:
        name, arguments = _read_whole(element)
    else:
        try:
            arguments = _arguments_member(element)
        except ValueError:
            arguments = _read_whole(element)[1]
    if not name:
        return None
    if not isinstance(name, str):  # (vLLM's FunctionCall refuses it)
        raise _Fails
    try:
        return name, retyped(arguments, properties(name))
    except RecursionError:
        raise _Fails from None


def _read_whole(element: str) -> tuple[Any, str]:
    """vLLM's ``_extract_name_and_args``: the element as JSON, its name and arguments."""
    body = element.strip()
    try:
        value = json.loads(body)
    except json.JSONDecodeError:
        return "", body
    except (ValueError, RecursionError):
        raise _Fails from None
    if not isinstance(value, dict):
        return "", body
    name = value.get("name", "")
    for key in ("arguments", "parameters"):
        if key in value:
            arguments = value[key]
            return name, arguments if isinstance(arguments, str) else \
                json.dumps(arguments, ensure_ascii=False)
    rest = {k: v for k, v in value.items() if k != "name"}
    return name, json.dumps(rest, ensure_ascii=False)


def _arguments_member(element: str) -> str:
    """The text of the element's top-level ``"arguments"`` object (to its end, or the
    element's), ``{}`` without one; ValueError when its value is no object (vLLM's
    ``extract_json_member_object``)."""
    depth, in_string, escaped, opened, key = 0, False, False, -1, False
    for i, c in enumerate(element):
        if escaped:
            escaped = False
        elif in_string:
            if c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
                if depth == 1:  # the last string closed at the top: a key, if ':' follows
                    key = i - opened == 10 and element.startswith("arguments", opened + 1)
        elif c == '"':
            in_string, opened = True, i
        elif c == ":" and depth == 1 and key:
            start = i + 1
            while start < len(element) and element[start] in _BLANKS:
                start += 1
            if start == len(element):
                return "{}"
            if element[start] != "{":
                raise ValueError("arguments that are no object")
            return element[start:_closing_brace(element, start, "{}")]
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
    return "{}"
