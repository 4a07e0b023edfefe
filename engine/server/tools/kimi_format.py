"""kimi_k2 (Kimi K2, K2.5): calls in a section between Kimi's special tokens, each named by
Kimi's own call id, read as the text grows (``CallScanner`` drives)::

    <|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0
    <|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>

Read as vLLM 0.32's parser engine reads a whole answer (``KimiK2Parser`` with no
reasoning parser beside it, so ``<think>`` is text): the content is the text before the
first ``<|tool_calls_section_begin|>``; after it, text outside a call is dropped, even
past the section's end. A call runs from ``<|tool_call_begin|>`` through a header, up to
``<|tool_call_argument_begin|>``, then its arguments, up to ``<|tool_call_end|>`` or
``<|tool_calls_section_end|>`` (any other marker inside is part of the header or the
arguments). The header's first line up to its last ``:DIGITS`` is the call's id
(``functions.get_weather:0``), the text before the id's first ``:`` less ``functions.`` its
name; the arguments are kept as written, less the whitespace around them (``{}`` when
none). A call whose header is no id is named by the first ``"name": "..."`` in its
arguments (a random id), or, with no arguments at all, by its header.

A call with an id goes out once its header is read, then its arguments as they are
written (whitespace held until more follows); one without, whole when it ends.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvledger.engine.server.tools.call_pieces import (
    Arguments,
    OpenCall,
    Piece,
    ToolCall,
    content_until,
    held,
)

SECTION_BEGIN, SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CALL_BEGIN, CALL_END = "<|tool_call_begin|>", "<|tool_call_end|>"
ARGUMENT_BEGIN = "<|tool_call_argument_begin|>"
MARKERS = (SECTION_BEGIN, SECTION_END, CALL_BEGIN, CALL_END, ARGUMENT_BEGIN)


def kimi_k2(scanner, text: str, final: bool) -> list[Piece]:
    out: list[Piece] = []
    if scanner.mode == "start":
        if content_until(scanner, text, (SECTION_BEGIN,), final, out) is None:
            return out
        scanner.mode, scanner.pos = "calls", scanner.pos + len(SECTION_BEGIN)
    while True:
        open_ = scanner.open
        if open_ is None:  # between calls: all but a call's start is dropped
            begin = scanner.find(text, CALL_BEGIN, scanner.pos)
            if begin < 0:
                return out
            open_ = scanner.open = OpenCall(begin + len(CALL_BEGIN), begin)
        if open_.state is None and not _header(scanner, open_, text, final, out):
            return out
        if not _arguments(scanner, open_, text, final, out):
            return out
        scanner.open = None


@dataclass
class _Read:
    """A call past its header: the header, where its arguments start, how far they are
    read (``scanned``), where the last non-space among them ends, and given out up to."""

    header: str
    start: int
    scanned: int
    last: int
    given: int


def _header(scanner, open_: OpenCall, text: str, final: bool, out: list[Piece]) -> bool:
    """Read the call's header up to ``<|tool_call_argument_begin|>`` (or the end): True
    once read; the call is given out when the header is an id."""
    found = scanner.find(text, ARGUMENT_BEGIN, open_.at)
    if found < 0 and not final:
        return False
    start = len(text) if found < 0 else found + len(ARGUMENT_BEGIN)
    open_.state = _Read(text[open_.at:len(text) if found < 0 else found], start, start,
                        start, start)
    named = call_id(open_.state.header)
    if named is not None:
        open_.call = ToolCall(named[1], id=named[0])
        out.append(open_.call)
    return True


def _arguments(scanner, open_: OpenCall, text: str, final: bool, out: list[Piece]) -> bool:
    """Give out a named call's arguments written so far, less the whitespace around them
    (each character looked at once); True once they end, the call given out whole if it
    is not named yet."""
    read = open_.state
    ends = [at for m in (CALL_END, SECTION_END) if (at := scanner.find(text, m, read.start)) >= 0]
    end = min(ends) if ends else None
    if end is None and not final:
        stop = len(text) - max(held(text, read.scanned, m) for m in (CALL_END, SECTION_END))
    else:
        stop = len(text) if end is None else end
    if stop > read.scanned:
        body = text[read.scanned:stop].rstrip()
        read.last = read.scanned + len(body) if body else read.last
        read.scanned = stop
    done = end is not None or final
    if open_.call is not None:
        piece = text[read.given:read.last]
        piece = piece.lstrip() if read.given == read.start else piece
        if done and read.given == read.start and not piece:
            piece = "{}"
        if piece:
            out.append(Arguments(open_.call, piece))
            read.given = read.last  # ("{}" ends the call: nothing is read after it)
    elif done:
        out += _unnamed(scanner, read.header, text[read.start:stop])
    if done:
        scanner.pos = len(text) if end is None else end + len(
            CALL_END if text.startswith(CALL_END, end) else SECTION_END)
    return done


def _unnamed(scanner, header: str, raw: str) -> list[Piece]:
    """A call whose header is no id, read whole: named by its arguments' first
    ``"name": "..."`` (itself an id or not), or by its header when it has no arguments."""
    if raw:
        name = (name_field(raw) or "").strip()
        named = call_id(name) if name else None
        if not name:
            return []
        call = ToolCall(named[1], id=named[0]) if named else \
            ToolCall(name, id=scanner.new_id())
        return [call, Arguments(call, raw.strip() or "{}")]
    name = header.strip()
    if not name:
        return []
    call = ToolCall(name, id=scanner.new_id())
    return [call, Arguments(call, "{}")]


def call_id(header: str) -> tuple[str, str] | None:
    """Kimi's id and the function's name in a header (vLLM's ``.+:\\d+`` matched at the
    start of the stripped header, one line), or None."""
    line = header.strip().split("\n", 1)[0]
    colon = line.rfind(":")
    while colon > 0 and not (colon + 1 < len(line) and line[colon + 1].isdecimal()):
        colon = line.rfind(":", 0, colon)
    if colon <= 0:
        return None
    digits = colon + 1
    while digits < len(line) and line[digits].isdecimal():
        digits += 1
    ident = line[:digits].strip()
    name = ident.split(":")[0].removeprefix("functions.").strip()
    return (ident, name) if name else None


def name_field(text: str) -> str | None:
    """The text of the first ``"name"\\s*:\\s*"..."`` in ``text`` (vLLM's pattern, read
    without backtracking: an attempt that reaches the value's opening quote matches or no
    later one can), or None when there is none or it is empty."""
    at = text.find('"name"')
    while at >= 0:
        i = at + len('"name"')
        while i < len(text) and text[i].isspace():
            i += 1
        if i < len(text) and text[i] == ":":
            i += 1
            while i < len(text) and text[i].isspace():
                i += 1
            if i < len(text) and text[i] == '"':
                close = text.find('"', i + 1)
                return (text[i + 1:close] or None) if close >= 0 else None
        at = text.find('"name"', at + 1)
    return None
