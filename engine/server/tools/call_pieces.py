"""What a format's reader gives ``CallScanner``: content strings, calls once named
(``ToolCall``) and more of their arguments (``Arguments``); the call being read
(``OpenCall``); each family's call ids; the content-until-a-marker step every reader
that looks for a start marker shares; and the streaming of the formats whose calls vLLM
reads from the whole answer (``read_at_end``)."""

from __future__ import annotations

import random
import string
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvledger.engine.server.tools.call_json import ArgumentsSpan


def openai_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def mistral_call_id() -> str:
    """Mistral's: 9 letters and digits (its chat templates refuse any other id)."""
    return "".join(random.choices(string.ascii_letters + string.digits, k=9))


def vllm_call_id() -> str:
    """vLLM 0.32's own (``make_tool_call_id``): ``chatcmpl-tool-`` and 16 hex digits."""
    return f"chatcmpl-tool-{uuid.uuid4().int & (1 << 64) - 1:016x}"


@dataclass
class ToolCall:
    name: str
    arguments: str = ""  # JSON text of an object; grows while streamed
    id: str = field(default_factory=openai_call_id)

    def as_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class Arguments:
    """More of ``call``'s arguments, as the reader found them."""

    call: ToolCall
    text: str


@dataclass
class OpenCall:
    """A call being read: where its text begins, then, once named, its arguments."""

    at: int               # its object's '{' (or, for ``name[ARGS]``, its name)
    back: int             # where the text goes back to being content if it is no call
    call: ToolCall | None = None
    span: ArgumentsSpan | None = None
    sent: int = 0         # characters of the arguments given out
    state: Any = None     # a format's own reading of the call (qwen3_coder's parameters)


Piece = str | ToolCall | Arguments


def whole_calls(scanner, calls: list[tuple[str, str]]) -> list[Piece]:
    """Calls read whole: each named, then all its arguments at once."""
    out: list[Piece] = []
    for name, arguments in calls:
        call = ToolCall(name, id=scanner.new_id())
        out += [call, Arguments(call, arguments)]
    return out


def content_until(scanner, text: str, markers: tuple[str, ...], final: bool,
                  out: list[Piece]) -> tuple[int, str] | None:
    """Content up to the first of ``markers`` (its position and which), holding back an
    end of the text that may yet become one; None when there is none yet."""
    pos = scanner.pos
    found = [(at, m) for m in markers if (at := scanner.find(text, m, pos)) >= 0]
    first = min(found) if found else None
    if first is not None:
        stop = first[0]
    elif final:
        stop = len(text)
    else:
        stop = len(text) - max(held(text, pos, m) for m in markers)
    if stop > pos:
        out.append(text[pos:stop])
    scanner.pos = stop
    return first


def held(text: str, pos: int, marker: str) -> int:
    """The length of ``text[pos:]``'s longest end that begins ``marker``."""
    for n in range(min(len(marker) - 1, len(text) - pos), 0, -1):
        if text.endswith(marker[:n]):  # (not a slice of the text: a step reads no copy)
            return n
    return 0


WholeReading = Callable[[str], tuple[str, list[tuple[str, str]]]]


def read_at_end(scanner, text: str, final: bool, markers: tuple[str, ...],
                read: WholeReading, hold: Callable[[str], bool] | None = None) -> list[Piece]:
    """A format vLLM reads from the whole answer, where any later text may still change
    what came before (one bad call making it all content): the content up to the first of
    ``markers`` as it is written (all of it held when ``hold`` says so of the answer's
    first text, or the answer is read whole at once), then, at the end, ``read(text)``'s
    content past what was given and its calls. ``read`` runs once, so it may read the
    whole answer (forward, a pass or a few)."""
    out: list[Piece] = []
    if scanner.mode == "start":
        if not text:
            return out
        held = final or (hold is not None and hold(text))  # (a whole answer: read whole)
        scanner.mode = "held" if held else "content"
    if scanner.mode == "content":
        if content_until(scanner, text, markers, final, out) is None:
            return out
        scanner.mode = "held"
    if not final:
        return out
    content, calls = read(str(text))
    given = text[:scanner.pos]
    if content.startswith(given) and len(content) > len(given):
        out.append(content[len(given):])
    scanner.pos = len(text)
    return out + whole_calls(scanner, calls)
