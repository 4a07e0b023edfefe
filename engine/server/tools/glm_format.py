"""glm45 and glm47 (GLM-4.5, 4.6, 4.7): calls as XML-like tags whose values are bare text,
typed by the request's tool schema, read as the text grows (``CallScanner`` drives)::

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    </tool_call>

Read as vLLM 0.32's ``Glm47MoeParser`` reads a whole answer with no reasoning parser
beside it (``<think>`` is text): a call runs from ``<tool_call>`` to ``</tool_call>`` (or
the text's end); its name is the text up to its first ``<arg_key>``, stripped, else the
first ``"name": "..."`` in its arguments; a call is made only when the name is one of the
request's tools (any name when it declares none). Its arguments are each
``<arg_key>K</arg_key>``, blanks, ``<arg_value>V</arg_value>`` pair as vLLM's pattern
finds them, the key stripped, the value as written, then typed by the tool's schema
(``schema_types``, the owner qwen3_coder's values share); a later key replaces an earlier
one's value in its place. When a call is made the content is the text before the first
``<tool_call>``, stripped at both ends; when none is, every text outside calls.

The stream adds up to that whole answer: content goes out as it comes unless the answer
begins with whitespace (held until the answer shows whether it makes a call: only then is
it known whether it is stripped); text after the first ``<tool_call>`` is held until a call
is made (then dropped) or the answer ends; each call goes out whole when it ends, its
arguments typed.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from kvledger.engine.server.tools.call_pieces import (
    Arguments,
    OpenCall,
    Piece,
    ToolCall,
    content_until,
)
from kvledger.engine.server.tools.kimi_format import name_field
from kvledger.engine.server.tools.schema_types import coerced

CALL_START, CALL_END = "<tool_call>", "</tool_call>"
KEY_START, KEY_END = "<arg_key>", "</arg_key>"
VALUE_START, VALUE_END = "<arg_value>", "</arg_value>"
MARKERS = (CALL_START, CALL_END, KEY_START, KEY_END, VALUE_START, VALUE_END)


class _Held:
    """The content not yet given out: the text before the first call when the answer
    begins blank, then the text outside calls after it, until a call is made."""

    def __init__(self) -> None:
        self.before: list[str] = []
        self.after: list[str] = []
        self.made = False  # a call was made: what is held after it is dropped


def glm45(scanner, text: str, final: bool) -> list[Piece]:
    out: list[Piece] = []
    if scanner.mode == "start":
        scanner.mode, scanner.state = "content", _Held()
    held: _Held = scanner.state
    while True:
        if scanner.open is None:
            if not _content(scanner, held, text, final, out):
                return out
            scanner.open = OpenCall(scanner.pos, scanner.pos - len(CALL_START))
            scanner.mode = "calls"
        end = scanner.find(text, CALL_END, scanner.open.at)
        if end < 0 and not final:
            return out
        stop = len(text) if end < 0 else end
        calls = _call(scanner, text[scanner.open.at:stop])
        if calls and not held.made:
            held.made = True
            if held.before:
                out.append("".join(held.before).strip())
            held.before.clear()
            held.after.clear()
        out += calls
        scanner.open = None
        scanner.pos = stop if end < 0 else end + len(CALL_END)
        if end < 0:
            return _flush(held, out, final)


def _content(scanner, held: _Held, text: str, final: bool, out: list[Piece]) -> bool:
    """Content up to the next ``<tool_call>`` (True once there is one), given out, held or
    dropped as the answer's reading so far says; at the end, all that is held."""
    before = scanner.mode == "content"
    if before and not held.before and scanner.pos == 0 and text and text[0].isspace():
        held.before.append("")  # the answer begins blank: hold its content
    piece: list[Piece] = []
    found = content_until(scanner, text, (CALL_START,), final, piece)
    for p in piece:
        if held.made:
            continue
        if not before:
            held.after.append(p)
        elif held.before:
            held.before.append(p)
        else:
            out.append(p)
    if found is None:
        _flush(held, out, final)
        return False
    scanner.pos += len(CALL_START)
    return True


def _flush(held: _Held, out: list[Piece], final: bool) -> list[Piece]:
    """At the end with no call made, the held content goes out (no call: not stripped)."""
    if final and not held.made:
        out.append("".join(held.before) + "".join(held.after))
        held.before.clear()
        held.after.clear()
    return out


def _call(scanner, body: str) -> list[Piece]:
    """One call's text (between its tags): the call and its arguments, or nothing when
    its name is none of the request's tools (or empty)."""
    key = body.find(KEY_START)
    name = (body if key < 0 else body[:key]).strip()
    raw = "" if key < 0 else body[key:]
    if not name:
        if not raw:
            return []
        name = (name_field(raw) or "").strip()
    if not name or not scanner.declares(name):
        return []
    properties = scanner.properties(name)
    values = {k: coerced(v, properties[k]) if k in properties else v
              for k, v in arguments(raw).items()}
    call = ToolCall(name, id=scanner.new_id())
    return [call, Arguments(call, json.dumps(values, ensure_ascii=False))]


def arguments(raw: str) -> dict[str, str]:
    """The key/value pairs in ``raw`` (``pairs``), a later key's value in an earlier one's
    place."""
    return dict(pairs(raw))


def pairs(raw: str, blank: Callable[[str], bool] = str.isspace) -> Iterator[tuple[str, str]]:
    """The keys (stripped) and values vLLM's
    ``<arg_key>(.*?)</arg_key>\\s*<arg_value>(.*?)</arg_value>`` finds in ``raw`` one after
    another (``pair_at`` each; where none matches at a key's tag, no later one can
    either). ``blank``: the pattern's ``\\s`` (the ``regex`` module's is Unicode's
    White_Space)."""
    pos, last = 0, raw.rfind(VALUE_END)
    while (start := raw.find(KEY_START, pos)) >= 0:
        pair = pair_at(raw, start, GLM_PAIRS, blank, last)
        if pair is None:
            return
        key, _, value, pos = pair
        yield key.strip(), value


@dataclass(frozen=True)
class PairTags:
    """A format's tags around a key and its value, and around the type some formats may
    write between them (``type_start`` "": none)."""

    key_start: str
    key_end: str
    value_start: str
    value_end: str
    type_start: str = ""
    type_end: str = ""


GLM_PAIRS = PairTags(KEY_START, KEY_END, VALUE_START, VALUE_END)


def pair_at(raw: str, start: int, tags: PairTags, blank: Callable[[str], bool], last: int
            ) -> tuple[str, str | None, str, int] | None:
    """The match of vLLM's pattern ``KEY(.*?)/KEY\\s*(?:TYPE(.*?)/TYPE\\s*)?VALUE(.*?)/VALUE``
    at ``start`` (a key's tag): the key, the type (None: not written), the value as
    written and where the match ends; None when it matches nowhere from ``start`` on.
    ``last``: where ``raw``'s last value's end is (-1: none). Read forward, never
    backtracking: the key runs to the first key's end that blanks and a value's tag
    follow, or a type whose end (the first that blanks and a value's tag follow) a
    value's end follows; the value to the first value's end."""
    key_at = start + len(tags.key_start)
    found = [-2, 0]  # the type's end last found (-1: none) and where that search began

    def type_end(at: int) -> int:
        """The first type's end at or after ``at`` that blanks and a value's tag follow
        (``at`` only grows: no text is searched twice)."""
        if found[0] >= at or (found[0] == -1 and found[1] <= at):
            return found[0]
        end = raw.find(tags.type_end, at)
        while end >= 0 and not raw.startswith(tags.value_start,
                                              _skipped(raw, end + len(tags.type_end), blank)):
            end = raw.find(tags.type_end, end + 1)
        found[:] = [end, at]
        return end

    close = raw.find(tags.key_end, key_at)
    while close >= 0:
        at, kind, value_at = _skipped(raw, close + len(tags.key_end), blank), None, -1
        if tags.type_start and raw.startswith(tags.type_start, at):
            end = type_end(at + len(tags.type_start))
            if end >= 0:  # (a later type's end would leave no value's end either)
                kind = raw[at + len(tags.type_start):end]
                value_at = _skipped(raw, end + len(tags.type_end), blank) + len(tags.value_start)
                value_at = value_at if value_at <= last else -1
        elif raw.startswith(tags.value_start, at):
            value_at = at + len(tags.value_start)
            if value_at > last:  # no value's end after this one: none after a later one
                return None
        if value_at >= 0:
            end = raw.find(tags.value_end, value_at)
            return raw[key_at:close], kind, raw[value_at:end], end + len(tags.value_end)
        close = raw.find(tags.key_end, close + 1)
    return None


def _skipped(raw: str, at: int, blank: Callable[[str], bool]) -> int:
    while at < len(raw) and blank(raw[at]):
        at += 1
    return at
