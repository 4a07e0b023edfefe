"""poolside_v1 (Poolside's models): GLM-4's calls, read as vLLM 0.32's
``PoolsideV1ToolParser`` reads a whole answer (its GLM-4 parser of before GLM-4.7)::

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    </tool_call>

A call runs from ``<tool_call>`` to the first ``</tool_call>`` after it (one never closed
is text). In it vLLM's ``<tool_call>\\s*([^\\n<]+?)\\s*\\n?\\s*(<arg_key>.*?)?</tool_call>``
is searched: from a ``<tool_call>`` (a later one inside the call when the first does not
match), a name, its text up to its first ``<`` with no line break but in the blanks
around it (blanks alone make the name ""), then nothing but ``<arg_key>`` pairs, read by
glm45's reader (``glm_format.pairs``). No name is checked against the tools. A value
stays the text written when the tool's schema gives its key ``"type": "string"``; others,
stripped, are JSON, else a Python literal, else the text. A call that matches nothing is
dropped; a value that cannot be JSON (a set, bytes) makes the whole answer content.
When a call is made the content is the text before the first ``<tool_call>``; else the
whole answer.

The stream sends the content before the first ``<tool_call>`` as it comes, and the calls
(or the rest as content) at the end: one failing value anywhere changes the answer.
"""

from __future__ import annotations

import ast
import json
import warnings
from typing import Any

from kvledger.engine.server.tools.call_pieces import Piece, content_until, whole_calls
from kvledger.engine.server.tools.glm_format import CALL_END, CALL_START, KEY_START, pairs
from kvledger.engine.server.tools.pythonic_format import REGEX_SPACES


def poolside_v1(scanner, text: str, final: bool) -> list[Piece]:
    out: list[Piece] = []
    if scanner.mode == "start":
        scanner.mode = "content"
    if scanner.mode == "content":
        if content_until(scanner, text, (CALL_START,), final, out) is None:
            return out
        scanner.mode = "calls"  # held from the first <tool_call> to the end
    if final:
        calls = _calls(scanner, text[scanner.pos:])
        out += [text[scanner.pos:]] if not calls else whole_calls(scanner, calls)
        scanner.pos = len(text)
    return out


def _calls(scanner, text: str) -> list[tuple[str, str]] | None:
    """The calls in ``text`` (which begins at the first ``<tool_call>``), or None."""
    calls, pos = [], 0
    while (start := text.find(CALL_START, pos)) >= 0:
        end = text.find(CALL_END, start + len(CALL_START))
        if end < 0:
            break
        found = _call(text[start:end])
        if found is not None:
            name, raw = found
            try:
                values = {}  # (each value typed, a later key's in an earlier one's place)
                for key, value in pairs(raw, REGEX_SPACES.__contains__):
                    values[key] = _value(scanner, name, key, value)
                calls.append((name, json.dumps(values, ensure_ascii=False)))
            except Exception:  # vLLM's: whatever fails, the whole answer is content
                return None
        pos = end + len(CALL_END)
    return calls


def _call(block: str) -> tuple[str, str] | None:
    """The name (stripped) and the ``<arg_key>`` text of vLLM's pattern's first match in
    ``block`` (from a ``<tool_call>`` up to its closing tag), or None."""
    at = 0
    while (at := block.find(CALL_START, at)) >= 0:
        at += len(CALL_START)
        less = block.find("<", at)
        head = block[at:] if less < 0 else block[at:less]
        if (less < 0 or block.startswith(KEY_START, less)) and _name_fits(head):
            return head.strip(), "" if less < 0 else block[less:]
        if less < 0:
            return None
        at = less
    return None


def _name_fits(head: str) -> bool:
    """Whether ``head`` is blanks, a name of no ``<`` or line break, blanks (``\\s`` the
    regex module's)."""
    first = 0
    while first < len(head) and head[first] in REGEX_SPACES:
        first += 1
    if first == len(head):  # blanks alone: the name is one of them, not a line break
        return any(c != "\n" for c in head)
    last = len(head)
    while head[last - 1] in REGEX_SPACES:
        last -= 1
    return "\n" not in head[first:last]


def _value(scanner, name: str, key: str, value: str) -> Any:
    """A value as vLLM types it: the text when the schema says string, else JSON, a
    Python literal or the text."""
    schema = scanner.schema(name)  # looked into as vLLM does (what raises: content)
    if schema is not None and schema.get("properties", {}).get(key, {}).get("type") == "string":
        return value
    value = value.strip()
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        pass
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", SyntaxWarning)
            return ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return value
