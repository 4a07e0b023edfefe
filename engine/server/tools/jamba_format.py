"""jamba (AI21 Jamba): a JSON list of the calls between ``<tool_calls>`` and
``</tool_calls>`` (special tokens of Jamba's tokenizer: ``CONTROL_TOKENS``), read as vLLM
0.32's ``JambaToolParser`` reads a whole answer (``CallScanner`` drives)::

    Let me check. <tool_calls>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</tool_calls>

vLLM's reading: the text between the first ``<tool_calls>`` and the first
``</tool_calls>`` after it is JSON; a list of objects each with a ``name`` (a string) and
``arguments`` (any JSON, written as ``json.dumps`` writes it) makes a call of each, the
content the text before ``<tool_calls>`` and nothing after the block (an empty list, or
an empty object or string, no call and the same content). Anything else, or no closing
tag, makes the whole answer content.

The stream gives out the content before ``<tool_calls>`` as it is written, then the calls
whole once ``</tool_calls>`` is read (or, where the block makes no calls, the rest as
content as it is written): no later text changes the reading of a closed block.
"""

from __future__ import annotations

from typing import Any

from kvledger.engine import json_text
from kvledger.engine.server.tools.call_json import dumped
from kvledger.engine.server.tools.call_pieces import Piece, content_until, whole_calls

TAG_START, TAG_END = "<tool_calls>", "</tool_calls>"
MARKERS = (TAG_START, TAG_END)


def jamba(scanner, text: str, final: bool) -> list[Piece]:
    out: list[Piece] = []
    if scanner.mode == "start":  # content, up to the block
        if content_until(scanner, text, (TAG_START,), final, out) is None:
            return out
        scanner.mode = "block"
    if scanner.mode == "block":
        end = scanner.find(text, TAG_END, scanner.pos + len(TAG_START))
        if end < 0 and not final:
            return out
        calls = None if end < 0 else listed_calls(text[scanner.pos + len(TAG_START):end])
        if calls is not None:  # the calls; the rest of the answer is nothing
            scanner.mode = "done"
            out += whole_calls(scanner, calls)
        else:
            scanner.mode = "content"
    if scanner.mode == "content" and len(text) > scanner.pos:
        out.append(text[scanner.pos:])
    scanner.pos = len(text)
    return out


def listed_calls(body: str) -> list[tuple[str, str]] | None:
    """The block's calls as vLLM's parser makes them, or None where it fails (it iterates
    the JSON value and indexes each item by ``name`` and ``arguments``)."""
    try:
        value: Any = json_text.loads(body)
    except ValueError:
        return None
    if isinstance(value, (dict, str)):  # (iterated: its keys or characters, none a call)
        return [] if not value else None
    if not isinstance(value, list):
        return None
    calls = [indexed_call(item) for item in value]
    return None if None in calls else calls


def indexed_call(item: Any) -> tuple[str, str] | None:
    """``item["name"]`` and ``json.dumps(item["arguments"])``, as vLLM's JSON parsers build
    a call (the name a string, as its ``FunctionCall`` checks), or None where that fails."""
    if not (isinstance(item, dict) and isinstance(item.get("name"), str)
            and "arguments" in item):
        return None
    arguments = dumped(item["arguments"])
    return None if arguments is None else (item["name"], arguments)
