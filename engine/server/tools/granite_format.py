"""IBM Granite's JSON calls, read as vLLM 0.32 reads a whole answer (``CallScanner``
drives; Granite 3's lists in ``granite3_format``)::

    <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>  (granite4)
    <function_call> {"name": "get_weather", "arguments": {"city": "Paris"}}   (granite-20b-fc)

- ``granite4`` (``Granite4ToolParser``): the answer is cut at each ``<tool_call>`` and
  ``</tool_call>``, which must alternate, opening first, each pair around some text and
  the last one closed; each call's text is one JSON object with a string ``name`` and
  ``arguments`` (a string as written, other JSON as ``json.dumps`` writes it, not null).
  Anything else makes the whole answer content; the content is the text outside the calls.
- ``granite-20b-fc`` (``Granite20bFCToolParser``): after each ``<function_call>`` and the
  blanks after it, up to the next one, the text begins with a JSON object with a string
  ``name`` and ``arguments`` (any JSON, as ``json.dumps`` writes it); text after the
  object is dropped. Any other makes the whole answer content; the content is the text
  before the first ``<function_call>``.

Both stream the content before their first marker as it is written, then the rest at the
end: until then a later call can still make the whole answer content (``read_at_end``).
"""

from __future__ import annotations

import json

from kvledger.engine import json_text
from kvledger.engine.server.tools.call_json import loose_call, regex_space
from kvledger.engine.server.tools.call_pieces import Piece, read_at_end

TOOL_CALL, TOOL_CALL_END = "<tool_call>", "</tool_call>"
FUNCTION_CALL = "<function_call>"
Calls = list[tuple[str, str]]


def granite4(scanner, text: str, final: bool) -> list[Piece]:
    return read_at_end(scanner, text, final, (TOOL_CALL, TOOL_CALL_END), read_granite4)


def granite_20b_fc(scanner, text: str, final: bool) -> list[Piece]:
    return read_at_end(scanner, text, final, (FUNCTION_CALL,), read_granite_20b_fc)


def read_granite4(text: str) -> tuple[str, Calls]:
    """The whole answer's content and calls, as ``Granite4ToolParser`` reads them."""
    content: list[str] = []
    calls: Calls = []
    pos, inside = 0, False
    found = {TOOL_CALL: -2, TOOL_CALL_END: -2}
    while (next_ := next_marker(text, pos, found)) is not None:
        at, marker = next_
        if (marker == TOOL_CALL) == inside:  # two openings, or a closing with none open
            return text, []
        if marker == TOOL_CALL:
            content.append(text[pos:at])
        else:
            try:
                call = loose_call(json_text.loads(text[pos:at]), strings_as_written=True)
            except ValueError:  # (an empty call's text too: vLLM asserts there is some)
                call = None
            if call is None:
                return text, []
            calls.append(call)
        inside = marker == TOOL_CALL
        pos = at + len(marker)
    if inside:
        return text, []
    return "".join(content) + text[pos:], calls


def read_granite_20b_fc(text: str) -> tuple[str, Calls]:
    """The whole answer's content and calls, as ``Granite20bFCToolParser`` reads them."""
    first = text.find(FUNCTION_CALL)
    if first < 0:
        return text, []
    decoder, calls = json.JSONDecoder(), []
    at = first
    while at >= 0:
        start = at + len(FUNCTION_CALL)
        while start < len(text) and regex_space(text[start]):
            start += 1
        at = text.find(FUNCTION_CALL, start)
        try:  # the object is read in its own stretch: it may not run into the next call
            value, _ = decoder.raw_decode(text[start:at] if at >= 0 else text[start:])
        except (ValueError, RecursionError):
            return text, []
        call = loose_call(value)
        if call is None:
            return text, []
        calls.append(call)
    return text[:first], calls


def next_marker(text: str, pos: int, found: dict[str, int]) -> tuple[int, str] | None:
    """The first of ``found``'s markers at or after ``pos``, and which; ``found`` keeps each
    one's next place (-2: not sought yet; -1: none further), so each is found once."""
    for marker, at in found.items():
        if at == -2 or 0 <= at < pos:
            found[marker] = text.find(marker, pos)
    places = [(at, m) for m, at in found.items() if at >= 0]
    return min(places) if places else None
