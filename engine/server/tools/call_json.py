"""A call's JSON read as the model writes it, for ``formats``.

``CallHead`` reads the head of a call object, ``{"name": "...", "arguments": `` (the order
every format's own examples write), as soon as it is complete, so a stream can send the
name before the arguments exist. ``ArgumentsSpan`` then follows the arguments object as it
grows: its end is the bracket that closes it, counted outside strings. ``read_call`` and
``json_calls`` read whole calls in any key order (a head written otherwise waits for them).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from kvledger.engine import json_text

ARGUMENTS_KEYS = ("arguments", "parameters")
_STRING = object()
_KEY = object()


def skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


def regex_space(c: str) -> bool:
    """Whether ``c`` is whitespace to vLLM's patterns (the ``regex`` module's ``\\s``):
    ``str.isspace``'s, less the four separators ``\\x1c``-``\\x1f``."""
    return c.isspace() and c not in "\x1c\x1d\x1e\x1f"


def literal_at(text: str, i: int, literal: str) -> int | Literal[False] | None:
    """The position after ``literal`` at ``text[i]``; None while ``text`` ends inside a prefix
    of it (more may make it); False when it is not there."""
    if text.startswith(literal, i):
        return i + len(literal)
    return None if literal.startswith(text[i:i + len(literal)]) else False


class CallHead:
    """``{"name": "<name>", "<key>": {`` read from a call's ``{`` at ``at`` as the text
    grows. Each ``read`` goes on from where the last stopped (the parts read, and inside
    the name how far, and whether after a backslash), so a model that writes a long run
    of whitespace or a long name before the arguments costs its length once, not once a
    step."""

    _PARTS = ("{", '"name"', ":", _STRING, ",", _KEY, ":", "{")

    def __init__(self, at: int, keys: tuple[str, ...] = ARGUMENTS_KEYS) -> None:
        self._pos = at
        self._part = 0
        self._keys = [f'"{k}"' for k in keys]
        self._name_at: int | None = None  # the name's opening quote, once there
        self._escaped = False
        self._name_text = ""
        self._result: tuple[str, int] | Literal[False] | None = None

    def read(self, text: str) -> tuple[str, int] | Literal[False] | None:
        """The name and the position of the arguments' ``{``; None while the text so far
        (the same text, grown) may yet become it; False when it cannot."""
        while self._result is None and self._part < len(self._PARTS):
            part = self._PARTS[self._part]
            if self._name_at is None:
                self._pos = skip_space(text, self._pos)
                if self._pos == len(text):
                    return None
            if part is _STRING:
                if not self._name(text):
                    return self._result
                continue
            found = [literal_at(text, self._pos, option)
                     for option in (self._keys if part is _KEY else [part])]
            if any(found):
                self._pos, self._part = next(f for f in found if f), self._part + 1
            elif any(f is None for f in found):
                return None
            else:
                self._result = False
        if self._result is None:
            self._result = self._name_text, self._pos - 1
        return self._result

    def _name(self, text: str) -> bool:
        """Read on in the name's JSON string; True once it is read (False: not yet, or
        ``_result`` says it cannot be)."""
        if self._name_at is None:
            if text[self._pos] != '"':
                self._result = False
                return False
            self._name_at, self._pos = self._pos, self._pos + 1
        j, escaped = self._pos, self._escaped
        while j < len(text):
            c = text[j]
            j += 1
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                try:
                    self._name_text = json_text.loads(text[self._name_at:j])
                except ValueError:
                    self._result = False
                    return False
                self._pos, self._part, self._name_at = j, self._part + 1, None
                return True
        self._pos, self._escaped = j, escaped
        return False


class ArgumentsSpan:
    """The arguments object that opens at ``text[start]``, followed as the text grows.

    ``advance`` reads on and says how much of the text is the arguments so far (trailing
    whitespace held back: it may be the last of them). ``end`` is set once they are over:
    after their closing bracket, or at ``stop`` (the format's end marker, outside strings)
    when that comes first; ``closed`` tells the two apart."""

    def __init__(self, start: int, stop: str | None = None) -> None:
        self.start = start
        self._stop = stop
        self._pos = start
        self._depth = 0
        self._in_string = False
        self._escaped = False
        # Where the run of whitespace that ends the text read so far begins (None: it ends
        # otherwise): held back without looking back over it, so a long run costs its
        # length once, not once a step.
        self._space_from: int | None = None
        self.end: int | None = None
        self.closed = False

    def advance(self, text: str) -> int:
        """Read ``text`` (the whole text so far); the position the arguments reach."""
        i = self._pos
        while self.end is None and i < len(text):
            c = text[i]
            if c in " \t\r\n":
                if self._space_from is None:
                    self._space_from = i
                self._escaped = False  # as any character after a backslash
                i += 1
                continue
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif c == "\\":
                    self._escaped = True
                elif c == '"':
                    self._in_string = False
            elif c == '"':
                self._in_string = True
            elif c in "{[":
                self._depth += 1
            elif c in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self.end, self.closed = i + 1, True
                    self._pos, self._space_from = i + 1, None
                    return self.end
            elif self._stop is not None and c == self._stop[0]:
                found = literal_at(text, i, self._stop)
                if found is None:  # maybe the end marker: wait for more
                    break
                if found:
                    self.end = i
                    break  # the marker is not the arguments'
            self._space_from = None
            i += 1
        self._pos = i
        return i if self._space_from is None else self._space_from

    def finish(self, text: str) -> int:
        """The text ended with the arguments open (cut by ``max_tokens``): they end here."""
        reached = self.advance(text)
        if self.end is None:
            self.end = len(text)
        return reached


def dumped(value: Any) -> str | None:
    """``json.dumps(value, ensure_ascii=False)`` (how vLLM writes the arguments it parsed),
    None for a value nested past what the encoder recurses into."""
    try:
        return json.dumps(value, ensure_ascii=False)
    except RecursionError:
        return None


def call_value(value: Any, keys: tuple[str, ...] = ARGUMENTS_KEYS) -> tuple[str, str] | None:
    """``{"name": ..., <key>: {...}}`` as a name and its arguments' JSON text, else None."""
    if not (isinstance(value, dict) and isinstance(value.get("name"), str)):
        return None
    arguments = next((value[k] for k in keys if k in value), None)
    if not isinstance(arguments, dict):
        return None
    return value["name"], json.dumps(arguments, ensure_ascii=False)


def loose_call(value: Any, keys: tuple[str, ...] = ("arguments",),
               strings_as_written: bool = False) -> tuple[str, str] | None:
    """``{"name": ..., KEY: ...}`` as vLLM's simpler JSON parsers (granite4,
    granite-20b-fc, phi4_mini_json) take it: the first of ``keys`` there, of any JSON type,
    as ``json.dumps`` writes it (with ``strings_as_written``, a string as written); None
    where vLLM's own call fails: no object, none of ``keys``, a name that is no string,
    (with ``strings_as_written``) null arguments."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    key = next((k for k in keys if k in value), None)
    if key is None:
        return None
    arguments = value[key]
    if strings_as_written and (arguments is None or isinstance(arguments, str)):
        return None if arguments is None else (value["name"], arguments)
    return value["name"], json.dumps(arguments, ensure_ascii=False)


def read_call(text: str, keys: tuple[str, ...] = ARGUMENTS_KEYS) -> tuple[str, str] | None:
    """A whole call object in ``text``, in any key order, or None."""
    try:
        return call_value(json_text.loads(text), keys)
    except ValueError:
        return None


def json_calls(text: str, separators: str) -> list[tuple[str, str]] | None:
    """Call objects one after another, apart by ``separators`` and whitespace (a JSON array
    of them too, when ``separators`` has ','), or None if any part is not one."""
    decoder = json.JSONDecoder()
    calls, i = [], 0
    while True:
        while i < len(text) and text[i] in " \t\r\n" + separators:
            i += 1
        if i == len(text):
            return calls or None
        try:
            value, i = decoder.raw_decode(text, i)
        except ValueError:
            return None
        values = value if isinstance(value, list) and "," in separators else [value]
        for item in values:
            call = call_value(item)
            if call is None:
                return None
            calls.append(call)
