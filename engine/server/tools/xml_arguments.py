"""qwen3_coder's arguments: the ``<parameter=NAME>\\nVALUE\\n</parameter>`` of one call,
read into the JSON object vLLM 0.32 makes of them, and given out as that JSON grows.

vLLM's reading (``vllm/parser/qwen3.py``, ``ParserEngine._fix_arg_types``): a parameter
ends at ``</parameter>`` or where the next ``<parameter=`` begins (whitespace allowed
inside either tag); one newline is trimmed from each end of its value; the value is a
string, turned into the type the tool's schema declares for it (``schema_types``); a
parameter left open when the call ends (``</function>``, or the text's end) is kept.

Its stream would give out JSON that the final value does not extend (a duplicated
parameter, an unclosed one dropped at the end); here every piece given out is a prefix of
the whole answer's object: a closed parameter goes out whole, an open one's key at once,
and its value as it is written only when the schema keeps it a string (held back: a
``<`` that may begin a tag, and the newline that may be the template's). A parameter
written twice keeps its first value (vLLM keeps the last, in the first one's place, and
its stream then breaks off).
"""

from __future__ import annotations

import json
import re
from typing import Any

from kvledger.engine.server.tools.schema_types import coerced, string_only

_HEAD_START = re.compile(r"<\s*parameter\s*=")
_HEAD = re.compile(r"<\s*parameter\s*=\s*([^>]*)>")
_OPEN_NAME = re.compile(r"\s*([^>]+)>")  # vLLM's open parameter's: no empty name
# Where a value ends: its closing tag, or the next parameter's opening (not consumed).
_CLOSE = re.compile(r"<\s*/\s*parameter\s*>|<\s*parameter\s*=")
# A value's end that may still become one of those tags.
_MAY_CLOSE = re.compile(r"<\s*(?:/\s*)?(?:p(?:a(?:r(?:a(?:m(?:e(?:t(?:e(?:r\s*)?)?)?)?)?)?)?)?)?")


def _trim(value: str) -> str:
    """One newline off each end: the template's, around every value."""
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


def _dump(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


class XmlArguments:
    """One call's parameters, read from its argument text (``advance``: the answer's text
    so far and where the arguments lie in it: read on from where the last step stopped,
    never sliced out whole) as it grows. ``properties``: the schemas of the declared function's parameters
    ({} for an undeclared function: every value stays a string)."""

    def __init__(self, properties: dict[str, Any]) -> None:
        self._properties = properties
        self._values: dict[str, Any] = {}  # closed parameters' values, as typed
        self._closed = ""       # their JSON members, joined
        self._head_from: int | None = None  # where the next parameter's opening may begin
        self._open: tuple[str, int] | None = None  # the open parameter: name, value start
        self._close_from = 0    # where its closing tag may begin
        self._value = ""        # its value given out so far (JSON-escaped, unquoted)
        self._value_end = 0     # where that value ends in the text
        self._sent = ""         # the JSON given out so far

    def advance(self, text: str, start: int, stop: int, final: bool) -> str:
        """What more of the arguments' JSON ``text[start:stop]`` gives out; with ``final``
        (the call is over), all the rest. Each call's ``start`` is the last one's."""
        if self._head_from is None:  # the first step: the arguments begin at ``start``
            self._head_from = self._close_from = self._value_end = start
        self._read(text, stop)
        if final:
            values = dict(self._values)
            if self._open is not None:
                named = _OPEN_NAME.match(text, text.index("=", self._head_from, stop) + 1, stop)
                if named and named.group(1) not in values:  # vLLM's name for an open one
                    values[named.group(1)] = self._typed(named.group(1),
                                                         _trim(text[self._open[1]:stop]))
            text = _dump(values)
        else:
            text = self._prefix(text, stop)
        if not text.startswith(self._sent) or len(text) <= len(self._sent):
            return ""
        more, self._sent = text[len(self._sent):], text
        return more

    def _read(self, raw: str, stop: int) -> None:
        """Close every parameter whose end is in ``raw[:stop]``, and find the open one."""
        while True:
            if self._open is None:
                found = _HEAD_START.search(raw, self._head_from, stop)
                if found is None:
                    last = raw.rfind("<", self._head_from, stop)
                    self._head_from = last if last >= 0 else stop
                    return
                self._head_from = found.start()
                head = _HEAD.match(raw, found.start(), stop)
                if head is None:  # no '>' yet
                    return
                self._open = (head.group(1), head.end())
                self._close_from = self._value_end = head.end()
                self._value = ""
            name, start = self._open
            close = _CLOSE.search(raw, self._close_from, stop)
            if close is None:
                last = raw.rfind("<", self._close_from, stop)
                self._close_from = last if last >= 0 else stop
                return
            if name not in self._values:
                value = self._values[name] = self._typed(name, _trim(raw[start:close.start()]))
                self._closed += (", " if self._closed else "") + f"{_dump(name)}: {_dump(value)}"
            end = close.end() if close.group().endswith(">") else close.start()
            self._open, self._head_from = None, end

    def _typed(self, name: str, value: str) -> Any:
        schema = self._properties.get(name)
        return value if schema is None else coerced(value, schema)

    def _prefix(self, raw: str, stop: int) -> str:
        """The JSON so far that no later text can change."""
        text = "{" + self._closed
        if self._open is not None:
            name, start = self._open
            if name and name not in self._values:  # (an empty name: given at the end)
                text += (", " if self._closed else "") + f"{_dump(name)}: "
                if string_only(self._properties.get(name)):
                    text += '"' + self._stable_value(raw, start, stop)
        return text if len(text) > 1 else ""

    def _stable_value(self, raw: str, start: int, stop: int) -> str:
        """The open value's part that stays, JSON-escaped: its first newline trimmed, and
        held back a ``<`` that may yet begin a tag and a last newline that may be the
        template's. Each call's is the last one's and more."""
        end = stop
        if self._close_from < end and _MAY_CLOSE.fullmatch(raw, self._close_from, stop):
            end = self._close_from  # (the last '<' after the value's start, if any)
        first = start + 1 if raw.startswith("\n", start) else start
        if end > first and raw[end - 1] == "\n":
            end -= 1
        if end > self._value_end:
            begin = max(self._value_end, first)
            self._value += _dump(raw[begin:end])[1:-1]
            self._value_end = end
        return self._value
