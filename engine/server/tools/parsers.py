"""Tool calls read back from a model's text, in the format of its family (``formats``:
hermes, llama3_json, mistral, qwen3_coder, pythonic and their other names).

One ``CallScanner`` reads a choice's text as it grows, for streamed and whole answers
alike, so what a stream sends adds up to what the whole answer holds: content as soon as
it cannot be the start of a call, a call as soon as its name is read, then its arguments
as they are written (``ArgumentsDelta``). The text it reads keeps the format's control
tokens (``CONTROL_TOKENS``: ``[TOOL_CALLS]``, ``<|python_tag|>``), which decoding for
users drops; the engine keeps them in the text of a request with tools.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvledger.engine.server.tools.formats import (
    CALL_IDS,
    CONTROL_TOKENS,
    READERS,
    Arguments,
    OpenCall,
    ToolCall,
)
from kvledger.engine.server.tools.protocol import Tool
from kvledger.engine.settings.vllm_rules import PARSERS

assert set(PARSERS) == set(READERS), "a --tool-call-parser name without its reader"
__all__ = ["CONTROL_TOKENS", "PARSERS", "ArgumentsDelta", "CallScanner", "ToolCall"]


@dataclass(frozen=True)
class ArgumentsDelta:
    """More of the arguments of the answer's call ``index``."""

    index: int
    text: str


class CallScanner:
    """A choice's text, fed as it grows (each ``feed`` the whole text so far), as content
    pieces, calls and their arguments, in order. At most ``max_calls`` calls
    (``parallel_tool_calls: false`` is 1): later calls are dropped, as vLLM drops them.
    Trailing whitespace is held until other content follows it, and dropped at the end
    (the newline before a call is no content). ``tools``: the request's, whose schemas
    type the values of formats that write them as bare text (qwen3_coder)."""

    def __init__(self, parser: str, max_calls: int | None = None,
                 tools: Sequence[Tool] = ()) -> None:
        if parser not in PARSERS:
            raise ValueError(f"unknown tool-call parser {parser!r}")
        self.parser = parser
        self._schemas = {t.function.name: t.function.schema for t in tools}
        self._read = READERS[parser]
        self.new_id = CALL_IDS[parser]
        self._max_calls = max_calls
        # The reader's place: characters read, the call being read, its own state.
        self.pos = 0
        self.open: OpenCall | None = None
        self.mode = "start"
        self.state: Any = None  # a format's own reading of the answer (GLM's held content)
        self._spaces: list[str] = []  # whitespace-only content held back, as it came
        self._kept: dict[int, int] = {}  # id() of each call given out -> its index
        self.calls: list[ToolCall] = []
        self.content = ""
        # Per marker: its next place found (or -1) and how much text that search read.
        self._next: dict[str, tuple[int, int]] = {}

    def find(self, text: str, marker: str, pos: int) -> int:
        """``text.find(marker, pos)``, remembered across calls: ``text`` only grows and
        ``pos`` only moves on, so no part of the text is searched twice for a marker.
        A reader looking for the first of several markers otherwise searched to the end
        for each absent one at every tag, quadratic in the answer (qwen3_coder: 4 s on the
        event loop for 16,000 ``<tool_call></tool_call>``)."""
        at, searched = self._next.get(marker, (-1, 0))
        if at >= pos:
            return at
        start = max(pos, searched - len(marker) + 1) if at < 0 else pos
        at = text.find(marker, start)
        self._next[marker] = (at, len(text))
        return at

    def properties(self, name: str) -> dict[str, Any]:
        """The schemas of the parameters of the declared function ``name`` ({} if none)."""
        properties = self._schemas.get(name, {}).get("properties")
        return properties if isinstance(properties, dict) else {}

    def schema(self, name: str) -> dict[str, Any] | None:
        """The arguments' schema of the declared function ``name`` (None if none)."""
        return self._schemas.get(name)

    def declares(self, name: str) -> bool:
        """Whether a call to ``name`` is one of the request's tools (any is, when it gave
        none): the formats vLLM checks names for (glm45) make no call to another."""
        return not self._schemas or name in self._schemas

    def index_of(self, call: ToolCall | ArgumentsDelta) -> int | None:
        """The index in the answer of a call this scanner gave out (OpenAI's delta index)."""
        return call.index if isinstance(call, ArgumentsDelta) else self._kept.get(id(call))

    def feed(self, text: str, final: bool) -> list[str | ToolCall | ArgumentsDelta]:
        """What ``text`` (the whole text so far) adds: content strings, calls (named, their
        arguments still to come) and their arguments; with ``final``, all that is left."""
        out: list[str | ToolCall | ArgumentsDelta] = []
        for piece in self._read(self, text, final):
            if isinstance(piece, ToolCall):
                if self._max_calls is None or len(self.calls) < self._max_calls:
                    self._kept[id(piece)] = len(self.calls)
                    self.calls.append(piece)
                    out.append(piece)
            elif isinstance(piece, Arguments):
                index = self._kept.get(id(piece.call))
                if index is not None:
                    piece.call.arguments += piece.text
                    out.append(ArgumentsDelta(index, piece.text))
            else:
                body = piece.rstrip()  # its trailing whitespace waits for what follows
                if body:  # (held as pieces: a long run of spaces costs its length once)
                    rest = piece[len(body):]
                    body, self._spaces = "".join(self._spaces) + body, [rest] if rest else []
                    self.content += body
                    out.append(body)
                else:
                    self._spaces.append(piece)
        return out
