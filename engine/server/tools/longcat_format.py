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
from kvledger.engine.server.tools.call_pieces import Piece, read_at_end
from kvledger.engine.server.tools.jamba_format import indexed_call

TAG_START, TAG_END = "<longcat_tool_call>", "</longcat_tool_call>"
MARKERS = (TAG_START, TAG_END)


def longcat(scanner, text: str, final: bool) -> list[Piece]:
    return read_at_end(scanner, text, final, (TAG_START,), read_longcat)


def read_longcat(text: str) -> tuple[str, list[tuple[str, str]]]:
    """The whole answer as vLLM reads it: the content before the first call and every
    call, or all of it content when one cannot be read (vLLM's all-or-none)."""
    first = text.find(TAG_START)
    if first < 0:
        return text, []
    calls, pos = [], first
    while (start := text.find(TAG_START, pos)) >= 0:
        end = text.find(TAG_END, start + len(TAG_START))
        end = len(text) if end < 0 else end
        pos = end + len(TAG_END)
        try:
            call = indexed_call(json_text.loads(text[start + len(TAG_START):end]))
        except ValueError:
            call = None
        if call is None:
            return text, []
        calls.append(call)
    return text[:first], calls
