"""The JSON call formats, read as the text grows (``CallScanner`` drives).

- ``hermes`` (Qwen2.5, Qwen3, Hermes; kvledger's built-in models): each call is
  ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``; text around them is
  content.
- ``llama3_json`` (Llama 3.1+): the answer is calls, ``{"name": ..., "parameters": {...}}``,
  several joined by ``;``, optionally after ``<|python_tag|>``; other text is content.
- ``mistral``: ``[TOOL_CALLS]`` (a special token: ``CONTROL_TOKENS``) then a JSON array of
  ``{"name": ..., "arguments": {...}}`` (tokenizers before v11; one bare object too), or
  ``[TOOL_CALLS]name[ARGS]{...}`` for each call (v11 and later); text before is content.

A call is given out once its name is read (``{"name": ..., "arguments": `` in that order,
or ``name[ARGS]``), then its arguments as they are written, exactly as written, up to the
bracket that closes them (or hermes' ``</tool_call>``, or the end of the text). A call
object written in another key order is read whole once complete. Text that never reaches
a name stays content.
"""

from __future__ import annotations

import string

from kvledger.engine.server.tools.call_json import (
    ArgumentsSpan,
    CallHead,
    json_calls,
    literal_at,
    read_call,
    skip_space,
)
from kvledger.engine.server.tools.call_pieces import (
    Arguments,
    OpenCall,
    Piece,
    ToolCall,
    content_until,
    whole_calls,
)


def _named(scanner, open_: OpenCall, name: str, args_at: int, out: list[Piece],
           stop: str | None = None) -> bool:
    open_.call = ToolCall(name, id=scanner.new_id())
    open_.span = ArgumentsSpan(args_at, stop)
    out.append(open_.call)
    return True


def _head(scanner, open_: OpenCall, text: str, final: bool, out: list[Piece],
          stop: str | None = None) -> bool | None:
    """Read the call's head: True once named (the call given out); None: wait for more;
    False: not written ``{"name": ..., "arguments": {`` (or never finished)."""
    if open_.state is None:  # read on from step to step until named
        open_.state = CallHead(open_.at)
    head = open_.state.read(text)
    if head is None:
        return False if final else None
    if head is False:
        return False
    return _named(scanner, open_, head[0], head[1], out, stop)


def _arguments(open_: OpenCall, text: str, final: bool, out: list[Piece]) -> bool:
    """Give out the arguments written since the last call; True once they are over."""
    span = open_.span
    reached = span.finish(text) if final else span.advance(text)
    start = span.start + open_.sent
    if reached > start:
        out.append(Arguments(open_.call, text[start:reached]))
        open_.sent = reached - span.start
    return span.end is not None


def _after_object(open_: OpenCall, text: str) -> int:
    """Past the arguments: past the call object's own '}' too, and the space around it."""
    i = skip_space(text, open_.span.end)
    if open_.span.closed and i < len(text) and text[i] == "}":
        i = skip_space(text, i + 1)
    return i


HERMES_START, HERMES_END = "<tool_call>", "</tool_call>"


def hermes(scanner, text: str, final: bool) -> list[Piece]:
    out: list[Piece] = []
    while True:
        open_ = scanner.open
        if open_ is None:
            found = content_until(scanner, text, (HERMES_START,), final, out)
            if found is None:
                return out
            open_ = scanner.open = OpenCall(found[0] + len(HERMES_START), found[0])
        if open_.call is None:
            named = _head(scanner, open_, text, final, out, stop=HERMES_END)
            if named is None:
                return out
            if not named:  # written otherwise: the whole body decides, once closed
                end = text.find(HERMES_END, open_.at)
                if end < 0 and not final:
                    return out
                stop = len(text) if end < 0 else end + len(HERMES_END)
                call = read_call(text[open_.at:end if end >= 0 else len(text)].strip())
                out += whole_calls(scanner, [call]) if call else [text[open_.back:stop]]
                scanner.pos, scanner.open = stop, None
                continue
        if not _arguments(open_, text, final, out):
            return out
        i = _after_object(open_, text)
        tag = literal_at(text, i, HERMES_END)
        if tag is None and not final:
            return out
        scanner.pos, scanner.open = tag or (len(text) if tag is None else i), None


PYTHON_TAG = "<|python_tag|>"


def llama3_json(scanner, text: str, final: bool) -> list[Piece]:
    out: list[Piece] = []
    while True:
        open_, pos = scanner.open, scanner.pos
        if open_ is None:
            if scanner.mode == "content":
                if len(text) > pos:
                    out.append(text[pos:])
                scanner.pos = len(text)
                return out
            i = skip_space(text, pos)
            if pos == 0:  # the answer may open with the tag
                tag = literal_at(text, i, PYTHON_TAG)
                if tag is None and not final:
                    return out
                i = skip_space(text, tag or i)
            if i == len(text) and not final:
                return out
            if i == len(text) or text[i] != "{":
                scanner.mode = "content"
                continue
            open_ = scanner.open = OpenCall(i, pos)
        if open_.call is None:
            named = _head(scanner, open_, text, final, out)
            if named is None or (not named and not final):
                return out
            if not named:  # written otherwise: the rest, read whole
                calls = json_calls(text[open_.at:], ";")
                out += whole_calls(scanner, calls or [])
                scanner.pos = len(text) if calls else open_.back
                scanner.open, scanner.mode = None, "content"
                continue
        if not _arguments(open_, text, final, out):
            return out
        i = _after_object(open_, text)
        if i == len(text) and not final:
            return out
        scanner.open = None
        if i < len(text) and text[i] == ";":
            scanner.pos = i + 1
        else:
            scanner.pos, scanner.mode = i, "content"


TOOL_CALLS, ARGS = "[TOOL_CALLS]", "[ARGS]"
_NAME_CHARS = frozenset(string.ascii_letters + string.digits + "_-.:")


def mistral(scanner, text: str, final: bool) -> list[Piece]:
    out: list[Piece] = []
    while True:
        open_ = scanner.open
        if open_ is None:
            found = content_until(scanner, text, (TOOL_CALLS,), final, out)
            if found is None:
                return out
            start = found[0]
            i = skip_space(text, start + len(TOOL_CALLS))
            if i == len(text) and not final:
                return out
            if i == len(text):
                out.append(text[start:])
                scanner.pos = len(text)
                return out
            scanner.mode = {"[": "array", "{": "object"}.get(text[i], "named")
            open_ = scanner.open = OpenCall(i + (text[i] == "["), start)
        if open_.call is None:
            named = (_mistral_name if scanner.mode == "named" else _head)(
                scanner, open_, text, final, out)
            if named is None or (not named and not final and scanner.mode != "named"):
                return out
            if not named and scanner.mode == "named":  # no name[ARGS]: the marker is text
                out.append(text[open_.back:open_.at])
                scanner.pos, scanner.open = open_.at, None
                continue
            if not named:  # JSON written otherwise: the rest, read whole (else content)
                calls = json_calls(text[open_.at:], ",]")
                out += whole_calls(scanner, calls) if calls else [text[open_.back:]]
                scanner.pos, scanner.open = len(text), None
                continue
        if not _arguments(open_, text, final, out):
            return out
        i = _after_object(open_, text) if scanner.mode != "named" else open_.span.end
        if i == len(text) and not final and scanner.mode != "named":
            return out
        if scanner.mode == "array":
            if i < len(text) and text[i] == ",":
                scanner.open = OpenCall(i + 1, i + 1)
                continue
            if i < len(text) and text[i] == "]":
                i += 1
        scanner.pos, scanner.open = i, None


def _mistral_name(scanner, open_: OpenCall, text: str, final: bool,
                  out: list[Piece]) -> bool | None:
    """``name[ARGS]{``: True once read (the call given out); None: wait; False: not so."""
    j = open_.at
    while j < len(text) and text[j] in _NAME_CHARS:
        j += 1
    found = literal_at(text, j, ARGS) if j > open_.at else False
    if found is None:
        return False if final else None
    if found is False:
        return False
    i = skip_space(text, found)
    if i == len(text):
        return False if final else None
    if text[i] != "{":
        return False
    return _named(scanner, open_, text[open_.at:j], i, out)
