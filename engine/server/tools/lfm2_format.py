"""lfm2 (LiquidAI LFM2, LFM2.5): pythonic's call lists between LFM2's tokens::

    <|tool_call_start|>[get_weather(city="Paris")]<|tool_call_end|>The weather is...

Read as vLLM 0.32's ``Lfm2ToolParser`` reads a whole answer: the text from the first
``<|tool_call_start|>`` to the next ``<|tool_call_end|>`` (or the end), stripped, must be
``[``...``]`` and parse as Python (else with ``python_repairs``' rewrites, the first that
parses) to a list of one or more calls, read as pythonic's; a keyword renamed to parse is
named back. Then the content is the text before the start, stripped, and the text after
the end less everything up to its last ``<|tool_call_end|>`` (LFM2 echoes its calls),
stripped, joined by a line break; else the whole answer is content.

The stream sends the content before ``<|tool_call_start|>`` as it comes (held to the end
when the answer begins blank: whether it is stripped is known only then), and the calls
and the rest at the end.
"""

from __future__ import annotations

import json

from kvledger.engine.server.tools.call_pieces import Piece, content_until, whole_calls
from kvledger.engine.server.tools.python_repairs import (
    closed_nested_quotes,
    escaped_controls,
    named_back,
    renamed_keywords,
    unpadded_integers,
)
from kvledger.engine.server.tools.pythonic_format import module_calls, parsed

CALL_START, CALL_END = "<|tool_call_start|>", "<|tool_call_end|>"


class _Before:
    """The content before the calls not given out yet: all of it when the answer begins
    blank, else the blanks at its end (stripped when calls are made)."""

    def __init__(self, blank: bool) -> None:
        self.blank = blank
        self.held: list[str] = []
        self.start = -1  # where <|tool_call_start|> is, once found


def lfm2(scanner, text: str, final: bool) -> list[Piece]:
    out: list[Piece] = []
    if scanner.mode == "start":
        if not text and not final:
            return out
        scanner.mode, scanner.state = "content", _Before(text[:1].isspace())
    before: _Before = scanner.state
    if scanner.mode == "content":
        pieces: list[Piece] = []
        found = content_until(scanner, text, (CALL_START,), final, pieces)
        for piece in pieces:
            _give(before, piece, out)
        if found is None:
            if final:
                out.append("".join(before.held))
            return out
        scanner.mode, before.start = "calls", scanner.pos
    if final:
        out += _answer(scanner, before, text)
        scanner.pos = len(text)
    return out


def _give(before: _Before, piece: str, out: list[Piece]) -> None:
    body = "" if before.blank else piece.rstrip()
    if not body:
        before.held.append(piece)
        return
    out.append("".join(before.held) + body)
    before.held = [piece[len(body):]]


def _answer(scanner, before: _Before, text: str) -> list[Piece]:
    """The answer's end, read whole: its calls and the content not given out yet."""
    at = before.start + len(CALL_START)
    end = text.find(CALL_END, at)
    calls = _calls(text[at:] if end < 0 else text[at:end])
    if calls is None:
        return ["".join(before.held) + text[before.start:]]
    head = text[:before.start].strip()
    out: list[Piece] = [head] if before.blank and head else []
    if end >= 0:
        after = text[end + len(CALL_END):]
        tail = after[after.rfind(CALL_END) + len(CALL_END):] if CALL_END in after else after
        if tail.strip():
            out.append(("\n" if head else "") + tail.strip())
    return out + whole_calls(scanner, calls)


def _calls(source: str) -> list[tuple[str, str]] | None:
    """The calls (names, JSON arguments) of the text between the tokens, or None."""
    source = source.strip()
    if len(source) < 2 or source[0] != "[" or source[-1] != "]":
        return None
    try:
        renamed = False
        try:
            module = parsed(source)
        except (SyntaxError, ValueError):
            module, renamed = _repaired(source)
        calls = module_calls(module)
        if renamed and calls:
            calls = [(name, json.dumps(named_back(json.loads(arguments)), ensure_ascii=False))
                     for name, arguments in calls]
        return calls or None
    except Exception:  # vLLM's: whatever fails, the answer is text
        return None


def _repaired(source: str):
    """The module of the first rewrite of ``source`` that parses, and whether keywords
    were renamed in the last one (vLLM names them back whichever parsed)."""
    escaped = escaped_controls(unpadded_integers(source))
    tries = [escaped]
    requoted, changed = closed_nested_quotes(escaped)
    if changed:
        tries.append(escaped_controls(requoted))
    renamed, was_renamed = renamed_keywords(tries[-1])
    if was_renamed:
        tries.append(renamed)
    for attempt in tries:
        try:
            return parsed(attempt), was_renamed
        except (SyntaxError, ValueError):
            continue
    raise ValueError("no rewrite parses")
