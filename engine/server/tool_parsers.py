"""Tool calls read back from a model's text, in the format of its family.

``hermes`` (Qwen2.5, Qwen3, Hermes; kvledger's built-in models): each call is
``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, text around them is
content. ``llama3_json`` (Llama 3.1+): the whole answer is calls,
``{"name": ..., "parameters": {...}}``, several joined by ``;``, optionally after
``<|python_tag|>``; anything else is content.

One ``CallScanner`` reads a choice's text as it grows, for streamed and whole answers
alike, so the calls and content a stream sends add up to what the whole answer holds: a
call goes out once its text is complete (whole, with its arguments), content as soon as it
cannot be the start of a call. Text that looks like a call but is not a well-formed one
stays content.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text of an object
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def as_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def read_call(text: str, arguments_keys: tuple[str, ...]) -> ToolCall | None:
    """``{"name": ..., <arguments key>: {...}}`` as a call, or None if it is not one."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return _call(value, arguments_keys)


def _call(value: Any, arguments_keys: tuple[str, ...]) -> ToolCall | None:
    if not (isinstance(value, dict) and isinstance(value.get("name"), str)):
        return None
    arguments = next((value[k] for k in arguments_keys if k in value), None)
    if not isinstance(arguments, dict):
        return None
    return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))


class CallScanner:
    """A choice's text, fed as it grows (each ``feed`` the whole text so far), as content
    pieces and calls in order. At most ``max_calls`` calls (``parallel_tool_calls: false``
    is 1): later well-formed calls are dropped. Trailing whitespace is held until other
    content follows it, and dropped at the end (the newline before a call is no content)."""

    def __init__(self, parser: str, max_calls: int | None = None) -> None:
        if parser not in PARSERS:
            raise ValueError(f"unknown tool-call parser {parser!r}")
        self.parser = parser
        self._max_calls = max_calls
        self._pos = 0          # characters of the text already read
        self._spaces = ""      # whitespace-only content held back
        self.calls: list[ToolCall] = []
        self.content = ""

    def feed(self, text: str, final: bool) -> list[str | ToolCall]:
        """What ``text`` (the whole text so far) adds: content strings and calls; with
        ``final``, everything that is left."""
        pieces = _hermes(self, text, final) if self.parser == "hermes" else \
            _llama3_json(self, text, final)
        out: list[str | ToolCall] = []
        for piece in pieces:
            if isinstance(piece, ToolCall):
                if self._max_calls is None or len(self.calls) < self._max_calls:
                    self.calls.append(piece)
                    out.append(piece)
                continue
            body = piece.rstrip()  # its trailing whitespace waits for what follows
            if body:
                body, self._spaces = self._spaces + body, piece[len(body):]
                self.content += body
                out.append(body)
            else:
                self._spaces += piece
        return out


_START, _END = "<tool_call>", "</tool_call>"


def _hermes(scanner: CallScanner, text: str, final: bool) -> list[str | ToolCall]:
    out: list[str | ToolCall] = []
    while scanner._pos < len(text):
        pos = scanner._pos
        start = text.find(_START, pos)
        if start < 0:  # content, but for an end that may yet become "<tool_call>"
            stop = len(text) if final else len(text) - _held(text, _START)
            if stop > pos:
                out.append(text[pos:stop])
            scanner._pos = stop
            break
        if start > pos:
            out.append(text[pos:start])
        end = text.find(_END, start)
        if end < 0 and not final:
            scanner._pos = start
            break
        stop = len(text) if end < 0 else end + len(_END)  # an unclosed last call counts
        body = text[start + len(_START):end if end >= 0 else len(text)]
        out.append(read_call(body.strip(), ("arguments", "parameters")) or text[start:stop])
        scanner._pos = stop
    return out


_PYTHON_TAG = "<|python_tag|>"


def _llama3_json(scanner: CallScanner, text: str, final: bool) -> list[str | ToolCall]:
    pos = scanner._pos
    rest = text[pos:]
    if pos == 0:
        head = rest.lstrip()
        calls_ahead = head.startswith(("{", _PYTHON_TAG)) or (
            not final and (not head or _PYTHON_TAG.startswith(head)))
        if calls_ahead and not final:
            return []  # calls are read once the answer is complete
        if calls_ahead:
            calls = _json_calls(head.removeprefix(_PYTHON_TAG))
            if calls is not None:
                scanner._pos = len(text)
                return list(calls)
    scanner._pos = len(text)
    return [rest] if rest else []


def _json_calls(text: str) -> list[ToolCall] | None:
    """``{...}; {...}`` as calls, or None if any part is not one."""
    decoder = json.JSONDecoder()
    calls, i = [], 0
    while True:
        while i < len(text) and text[i] in " \t\r\n;":
            i += 1
        if i == len(text):
            return calls or None
        try:
            value, i = decoder.raw_decode(text, i)
        except ValueError:
            return None
        call = _call(value, ("parameters", "arguments"))
        if call is None:
            return None
        calls.append(call)


def _held(text: str, marker: str) -> int:
    """The length of ``text``'s longest end that begins ``marker`` (held back, unsent)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


PARSERS = ("hermes", "llama3_json")
