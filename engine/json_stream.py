"""A JSON object read one member at a time from a stream, for files from outside that may
be large: a safetensors header, a checkpoint's index.

``json.loads`` builds the whole value at once, and what that costs is not the text's size:
30 MiB of ``"a":"b",`` pairs or ``[],`` lists become hundreds of MiB of Python objects.
Here the text is decoded in chunks and each member's value is parsed by json's own (C)
scanner in a window that never holds more than ``MEMBER_MAX_CHARS`` past the member's
start, so a member is at most that big, and what a file costs is the window and what the
caller keeps of each member. Nesting past the interpreter's recursion and every other
malformation are ``MalformedJson`` (a ValueError), never a ``RecursionError``.
"""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import Callable
from json.decoder import scanstring
from json.scanner import make_scanner
from typing import Any

CHUNK_BYTES = 1 << 18
# A safetensors header's entry is ~100 bytes and its __metadata__ rarely a few KiB.
MEMBER_MAX_CHARS = 1 << 20
# A text this small is parsed at once (json's C parser, at a fraction of the cost of
# reading it member by member; what that builds is bounded by it too).
WHOLE_MAX_CHARS = MEMBER_MAX_CHARS
# json's int() refuses a number of more than sys.get_int_max_str_digits() (4,300) digits
# with a bare ValueError; no size or offset has a twentieth of that.
TOO_MANY_DIGITS = "a number of more digits than Python reads"
_SPACE = re.compile(r"[ \t\n\r]*")
_SPACES = frozenset(" \t\n\r")
_VALUE_STARTS = frozenset('[{"-0123456789tfn')


class MalformedJson(ValueError):
    """The text is not valid JSON; the message says how, in a few words."""


class NotAnObject(MalformedJson):
    """Valid or not, the text does not begin with a JSON object."""

    def __init__(self) -> None:
        super().__init__("not a JSON object")


class ObjectReader:
    """Members of the JSON object in ``read`` (``read(n)`` returns at most n bytes, b"" at
    the end): ``begin()``, then ``key()`` until it returns None, each key followed by
    ``value()``, or by ``begin()`` for a member that is itself read member by member;
    ``end()`` checks nothing but whitespace follows. ``object_pairs_hook`` is json's, for
    every object parsed whole (a reader that refuses a key given twice)."""

    def __init__(self, read: Callable[[int], bytes],
                 object_pairs_hook: Callable[[list[tuple[str, Any]]], Any] | None = None,
                 ) -> None:
        self._read = read
        self._decoder = codecs.getincrementaldecoder("utf-8")()
        self._scan = make_scanner(json.JSONDecoder(object_pairs_hook=object_pairs_hook))
        self._text, self._pos, self._eof = "", 0, False
        self._member = self._value = 0  # where the current member, its value start
        self._first: list[bool] = []  # per open object: no member read yet

    def whole_object(self) -> dict | None:
        """The whole object, parsed at once by json's C parser, when all of the text fits
        in one window (what that costs is bounded by the window; every real safetensors
        header does fit), else None: read it member by member."""
        self._fill()
        pos = _SPACE.match(self._text, self._pos).end()
        if self._text[pos:pos + 1] != "{":
            raise NotAnObject() if self._text[pos:pos + 1] in _VALUE_STARTS else MalformedJson(
                "expecting a value")
        if not self._eof or len(self._text) - pos > WHOLE_MAX_CHARS:
            return None
        try:
            value, end = self._scan(self._text, pos)
        except StopIteration:
            raise MalformedJson("expecting a value") from None
        except json.JSONDecodeError as exc:
            raise MalformedJson(_reason(exc)) from None
        except RecursionError:
            raise MalformedJson("JSON nested too deeply") from None
        except MalformedJson:  # the object_pairs_hook's refusal, as it said
            raise
        except ValueError:
            raise MalformedJson(TOO_MANY_DIGITS) from None
        if _SPACE.match(self._text, end).end() != len(self._text):
            raise MalformedJson("extra data after the value")
        return value

    def text(self) -> str:
        """The window's text: after ``whole_object()`` returned one, all of it."""
        return self._text

    def begin(self) -> None:
        """Enter the object that starts here."""
        if not self._first:
            self._fill()
            self._skip_space()
            if self._peek() != "{":
                raise NotAnObject() if self._peek() in _VALUE_STARTS else MalformedJson(
                    "expecting a value")
        self._expect("{", "expecting '{'")
        self._first.append(True)

    def key(self) -> str | None:
        """The next member's key (its ``:`` consumed), or None where the object ends."""
        # The hot path of a 70B's headers and index (thousands of members): inlined.
        if not self._eof and len(self._text) - self._pos < MEMBER_MAX_CHARS:
            self._fill()
        text, pos = self._text, self._pos
        if text[pos:pos + 1] in _SPACES:
            pos = _SPACE.match(text, pos).end()
        self._member = pos
        char = text[pos:pos + 1]
        if char == "}":
            self._pos = pos + 1
            self._first.pop()
            return None
        if not self._first[-1]:
            if char != ",":
                raise MalformedJson("expecting ',' between members" if char
                                    else "the text ends too soon")
            pos += 1
            if text[pos:pos + 1] in _SPACES:
                pos = _SPACE.match(text, pos).end()
            char = text[pos:pos + 1]
        self._first[-1] = False
        if char != '"':
            raise MalformedJson("expecting a member's name in double quotes")
        try:
            key, pos = scanstring(text, pos + 1)
        except json.JSONDecodeError as exc:
            raise self._failed(exc) from None
        if text[pos:pos + 1] in _SPACES:
            pos = _SPACE.match(text, pos).end()
        if text[pos:pos + 1] != ":":
            self._pos = pos
            self._bounded()
            raise MalformedJson("expecting ':' after a member's name")
        pos += 1
        if text[pos:pos + 1] in _SPACES:
            pos = _SPACE.match(text, pos).end()
        self._pos = pos
        self._bounded()
        return key

    def value(self) -> Any:
        """The current member's value, parsed whole (a member is at most
        ``MEMBER_MAX_CHARS``)."""
        self._value = self._pos
        try:
            value, self._pos = self._scan(self._text, self._pos)
        except StopIteration as stop:  # json's C scanner: no value where one must be
            raise self._failed(json.JSONDecodeError("expecting a value", self._text,
                                                    stop.value)) from None
        except json.JSONDecodeError as exc:
            raise self._failed(exc) from None
        except RecursionError:
            raise MalformedJson("JSON nested too deeply") from None
        except MalformedJson:  # the object_pairs_hook's refusal, as it said
            raise
        except ValueError:
            raise MalformedJson(TOO_MANY_DIGITS) from None
        self._bounded()
        return value

    def peek(self) -> str:
        """The first character of the current member's value: ``{`` for one to ``begin()``."""
        self._skip_space()
        return self._peek()

    def value_text(self) -> str:
        """The text of the value just read (until the next ``key()``)."""
        return self._text[self._value:self._pos]

    def end(self) -> None:
        """Nothing but whitespace may follow the object."""
        while True:
            self._skip_space()
            if self._pos < len(self._text):
                raise MalformedJson("extra data after the object")
            if self._eof:
                return
            self._text, self._pos = "", 0
            self._more()

    # -- the window ---------------------------------------------------------------------

    def _fill(self) -> None:
        """At least ``MEMBER_MAX_CHARS`` decoded past the position, or all there is; only
        at a member's start, so positions within a member stay put."""
        if self._pos > CHUNK_BYTES:
            self._text, self._pos = self._text[self._pos:], 0
        while not self._eof and len(self._text) - self._pos < MEMBER_MAX_CHARS:
            self._more()

    def _more(self) -> None:
        chunk = self._read(CHUNK_BYTES)
        try:
            self._text += self._decoder.decode(chunk, final=not chunk)
        except UnicodeDecodeError as exc:
            raise MalformedJson(f"not UTF-8 ({exc.reason})") from None
        self._eof = not chunk

    def _bounded(self) -> None:
        """A member that reached the window's end before the text's is too large to read:
        the window held ``MEMBER_MAX_CHARS`` past the member's start."""
        if self._pos - self._member > MEMBER_MAX_CHARS or (
                self._pos >= len(self._text) and not self._eof):
            raise self._too_large()

    def _failed(self, exc: json.JSONDecodeError) -> MalformedJson:
        """What json's scanner said, unless it stopped where the window does (a string
        left open, or the text ending mid-value) while the text goes on: then the member is
        too large to read, not malformed."""
        if not self._eof and (exc.msg.startswith("Unterminated") or exc.pos >= len(self._text)):
            return self._too_large()
        return MalformedJson(_reason(exc))

    def _too_large(self) -> MalformedJson:
        return MalformedJson(f"a member is over {MEMBER_MAX_CHARS >> 20} MiB")

    def _skip_space(self) -> None:
        self._pos = _SPACE.match(self._text, self._pos).end()

    def _peek(self) -> str:
        return self._text[self._pos:self._pos + 1]

    def _expect(self, char: str, otherwise: str) -> None:
        self._skip_space()
        if self._peek() != char:
            raise MalformedJson(otherwise if self._peek() else "the text ends too soon")
        self._pos += 1


def _reason(exc: Exception) -> str:
    return getattr(exc, "msg", None) or str(exc)
