"""step3 (Step-3): calls between Step's special tokens, each an XML-like invoke whose
values are bare text, read as the text grows (``CallScanner`` drives)::

    <｜tool_calls_begin｜><｜tool_call_begin｜>function<｜tool_sep｜><steptml:invoke name="get_weather"><steptml:parameter name="city">Paris</steptml:parameter></steptml:invoke><｜tool_call_end｜><｜tool_calls_end｜>

Read as vLLM 0.32's ``Step3ToolParser`` reads a whole answer: without
``<｜tool_calls_begin｜>`` and a ``<｜tool_calls_end｜>`` after it, the answer is content.
The block between them is cut at each ``<｜tool_call_begin｜>``; each piece holding a
``<｜tool_call_end｜>`` is a call when the text before it holds ``<｜tool_sep｜>`` with
``function`` (blanks around it) before that, and after it an
``<steptml:invoke name="NAME">`` (the first one). Its arguments are each
``<steptml:parameter name="K">V</steptml:parameter>`` after the sep with no ``<`` in V
(a later key replaces an earlier one's value in its place), V stripped, then typed by
the declared tool's schema as vLLM does it: a ``type`` of integer, number, boolean or
null that the text is, else the text. Any name makes a call (vLLM checks none). When a
call is made the content is the text outside the block, stripped at both ends; when none
is, the whole answer.

One difference: a number parameter written ``inf`` or ``nan`` stays the text (vLLM's
arguments would hold ``Infinity``/``NaN``, which is not JSON).

The stream gives out the content before ``<｜tool_calls_begin｜>`` as it comes unless
the answer begins blank (held until the block shows whether a call is made: only then
is it known whether it is stripped), then all the calls whole once
``<｜tool_calls_end｜>`` is read (until then the block may still be content), then the
rest as content.
"""

from __future__ import annotations

import contextlib
import json
import math
from typing import Any

from kvledger.engine.server.tools.call_pieces import Piece, content_until, whole_calls

CALLS_BEGIN, CALLS_END = "<｜tool_calls_begin｜>", "<｜tool_calls_end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool_call_begin｜>", "<｜tool_call_end｜>", "<｜tool_sep｜>"
MARKERS = (CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEP)
INVOKE, PARAMETER = '<steptml:invoke name="', '<steptml:parameter name="'
PARAMETER_END = "</steptml:parameter>"


class _Answer:
    """The reading of the answer so far: the content held back, where the block is."""

    def __init__(self, hold: bool) -> None:
        self.hold = hold         # the answer begins blank: its first content waits
        self.before: list[str] = []
        self.blank = True        # no content but blanks before the block
        self.begin = -1          # where <｜tool_calls_begin｜> is, once read
        self.strip = False       # a call was made and no content yet: strip what follows


def step3(scanner, text: str, final: bool) -> list[Piece]:
    out: list[Piece] = []
    if scanner.mode == "start":
        if not text:
            return out
        scanner.mode, scanner.state = "content", _Answer(text[0].isspace())
    answer: _Answer = scanner.state
    if scanner.mode == "content":
        piece: list[Piece] = []
        found = content_until(scanner, text, (CALLS_BEGIN,), final, piece)
        for p in piece:
            answer.blank = answer.blank and not p.strip()
            (answer.before if answer.hold else out).append(p)
        if found is None:
            return [*out, "".join(answer.before)] if final else out
        answer.begin, scanner.mode = found[0], "block"
        scanner.pos = found[0] + len(CALLS_BEGIN)
    if scanner.mode == "block":
        end = scanner.find(text, CALLS_END, scanner.pos)
        if end < 0:
            if final:  # no block: the whole answer is content
                out += ["".join(answer.before) + text[answer.begin:]]
                scanner.pos = len(text)
            return out
        calls = block_calls(scanner, text[scanner.pos:end])
        stop = end + len(CALLS_END)
        if calls:
            out += ["".join(answer.before).lstrip(), *whole_calls(scanner, calls)]
            answer.strip = answer.blank
        else:
            out.append("".join(answer.before) + text[answer.begin:stop])
        answer.before.clear()
        scanner.mode, scanner.pos = "after", stop
    rest = text[scanner.pos:]
    if answer.strip:
        rest = rest.lstrip()
        answer.strip = not rest
    scanner.pos = len(text)
    return [*out, rest] if rest else out


def block_calls(scanner, block: str) -> list[tuple[str, str]]:
    """The calls vLLM reads in the text between the block's markers, in order."""
    calls = []
    for part in block.split(CALL_BEGIN):
        end = part.find(CALL_END)
        sep = part.find(SEP, 0, max(end, 0))
        if end < 0 or sep < 0 or part[:sep].strip() != "function":
            continue
        invoke = part[sep + len(SEP):end]
        name = _invoke_name(invoke)
        if name is not None:
            values = typed(parameters(invoke), scanner.properties(name))
            calls.append((name, json.dumps(values, ensure_ascii=False)))
    return calls


def _quoted(text: str, at: int) -> tuple[str, int] | None:
    """The name ``[^"]+`` at ``at`` and where its ``">`` ends, or None: it runs to the
    next quote (each tag holds one, so no name is read past the next tag)."""
    quote = text.find('"', at)
    if quote <= at or not text.startswith('">', quote):
        return None
    return text[at:quote], quote + 2


def _invoke_name(invoke: str) -> str | None:
    """The name of the first ``<steptml:invoke name="NAME">`` in ``invoke``."""
    pos = 0
    while (at := invoke.find(INVOKE, pos)) >= 0:
        named = _quoted(invoke, at + len(INVOKE))
        if named is not None:
            return named[0]
        pos = at + 1
    return None


def parameters(invoke: str) -> dict[str, str]:
    """The parameters vLLM's ``findall`` reads, left to right, never overlapping: each
    value runs to the next ``<`` (each tag begins with one), which must begin the close."""
    values: dict[str, str] = {}
    pos = 0
    while (at := invoke.find(PARAMETER, pos)) >= 0:
        named = _quoted(invoke, at + len(PARAMETER))
        pos = at + 1
        if named is None:
            continue
        key, start = named
        stop = invoke.find("<", start)
        if stop >= 0 and invoke.startswith(PARAMETER_END, stop):
            values[key] = invoke[start:stop].strip()
            pos = stop + len(PARAMETER_END)
    return values


def typed(values: dict[str, str], properties: dict[str, Any]) -> dict[str, Any]:
    """Each value as vLLM's ``_cast_arguments`` types it by its property's ``type``."""
    out: dict[str, Any] = {}
    for key, value in values.items():
        prop = properties.get(key)
        kind = prop.get("type") if isinstance(prop, dict) else None
        out[key] = value
        if kind == "integer":
            with contextlib.suppress(ValueError):
                out[key] = int(value)
        elif kind == "number":
            with contextlib.suppress(ValueError):
                number = float(value)
                out[key] = number if math.isfinite(number) else value
        elif kind == "boolean" and value.lower() in ("true", "false"):
            out[key] = value.lower() == "true"
        elif kind == "null" and value.lower() == "null":
            out[key] = None
    return out
