"""longcat (Meituan LongCat-Flash): each call a JSON object in ``<longcat_tool_call>``
tags, read as vLLM 0.32's ``LongcatFlashToolParser`` (its hermes parser with LongCat's
tags) reads a whole answer (``CallScanner`` drives)::

    Let me check.<longcat_tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </longcat_tool_call>

vLLM's reading: each ``<longcat_tool_call>`` opens a call that runs to the first closing
tag after it (or, with none, to the end); every call's text must be one JSON object with
a string ``name`` and ``arguments`` (any JSON, written as ``json.dumps`` writes it), else
the whole answer is content. The content is the text before the first call; text after it
is no content.

Unlike kvledger's hermes reader (which streams each call's arguments as written, and
keeps the calls it can read), the stream gives out the content before the first call as it
is written and the calls at the end: any later call that cannot be read makes the whole
answer content.
"""

from __future__ import annotations

from kvledger.engine import json_text
from kvledger.engine.server.tools.call_pieces import Piece, content_until, whole_calls
from kvledger.engine.server.tools.jamba_format import indexed_call

TAG_START, TAG_END = "<longcat_tool_call>", "</longcat_tool_call>"
MARKERS = (TAG_START, TAG_END)


def longcat(scanner, text: str, final: bool) -> list[Piece]:
    out: list[Piece] = []
    if scanner.mode == "start":  # content, up to the first call
        if content_until(scanner, text, (TAG_START,), final, out) is None:
            return out
        scanner.mode = "calls"
    if not final:
        return out
    calls, pos = [], scanner.pos
    while (start := text.find(TAG_START, pos)) >= 0:
        end = text.find(TAG_END, start + len(TAG_START))
        end = len(text) if end < 0 else end
        pos = end + len(TAG_END)
        try:
            call = indexed_call(json_text.loads(text[start + len(TAG_START):end]))
        except ValueError:
            call = None
        if call is None:  # vLLM's parser fails: the whole answer is content
            out.append(text[scanner.pos:])
            scanner.pos = len(text)
            return out
        calls.append(call)
    scanner.pos = len(text)
    return out + whole_calls(scanner, calls)
