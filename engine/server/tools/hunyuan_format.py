"""hunyuan_a13b (Tencent Hunyuan-A13B): a JSON list of the calls in ``<tool_calls>`` tags,
read as vLLM 0.32's ``HunyuanA13BToolParser`` reads a whole answer (``CallScanner``
drives)::

    <tool_calls>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</tool_calls>

vLLM's reading: the first ``<tool_calls>...</tool_calls>`` (each to the first closing tag
after it) that lies outside every ``<think>...</think>`` and whose text, stripped, is
JSON. Where there is none, the answer is content, less the first ``助手：`` (the reply
prefix Hunyuan's chat template asks of an answer without calls). Else the content is the
text before that block (nothing after it is kept); JSON that is no list makes no call;
each object in the list with ``name`` and ``arguments`` makes a call (object arguments as
``json.dumps`` writes them, a string as written; others are skipped); a name that is no
string or arguments of another type make the whole answer content.

One difference, so that an answer without calls streams: the first ``助手：`` before any
``<tool_calls>`` leaves the content whether calls follow or not (vLLM's answer with calls
keeps it). The stream gives out the content up to the first ``<tool_calls>`` as it is
written, and the rest at the end, where a later ``</think>`` may still make an earlier
block reasoning's. Every tag is found reading forward (vLLM's lazy patterns, without
their backtracking).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from kvledger.engine import json_text
from kvledger.engine.server.tools.call_json import dumped
from kvledger.engine.server.tools.call_pieces import Piece, content_until, whole_calls
from kvledger.engine.server.tools.jamba_format import TAG_END, TAG_START

MARKERS = (TAG_START, TAG_END)
REPLY = "助手："  # "Assistant:"
THINK_START, THINK_END = "<think>", "</think>"


def hunyuan_a13b(scanner, text: str, final: bool) -> list[Piece]:
    out: list[Piece] = []
    if scanner.mode == "start":
        scanner.mode, scanner.state = "content", None  # state: where the REPLY was
    if scanner.mode == "content":
        markers = (TAG_START,) if scanner.state is not None else (TAG_START, REPLY)
        found = content_until(scanner, text, markers, final, out)
        if found is not None and found[1] == REPLY:  # dropped; the content goes on
            scanner.state, scanner.pos = found[0], found[0] + len(REPLY)
            found = content_until(scanner, text, (TAG_START,), final, out)
        if found is None:
            return out
        scanner.mode = "held"
    if not final:
        return out
    content, calls, replied = read(text)
    given = scanner.pos
    if scanner.state is not None:
        given -= len(REPLY)
        if not replied:
            content = content[:scanner.state] + content[scanner.state + len(REPLY):]
    if len(content) > given:
        out.append(content[given:])
    scanner.pos = len(text)
    return out + whole_calls(scanner, calls)


def read(text: str) -> tuple[str, list[tuple[str, str]], bool]:
    """The whole answer's content and calls as vLLM reads them, and whether its first
    ``REPLY`` was dropped from the content."""
    found = _first_block(text)
    if found is None:
        return text.replace(REPLY, "", 1), [], True
    start, value = found
    content = text[:start]
    if not isinstance(value, list):
        return content or text, [], False
    calls = []
    for item in value:
        if not (isinstance(item, dict) and "name" in item and "arguments" in item):
            continue
        name, arguments = item["name"], item["arguments"]
        if isinstance(arguments, dict):
            arguments = dumped(arguments)
        if not (isinstance(name, str) and isinstance(arguments, str)):
            return text, [], False  # vLLM's call fails its own validation: all content
        calls.append((name, arguments))
    return content, calls, False


def _first_block(text: str) -> tuple[int, Any] | None:
    """The first block outside reasoning whose text is JSON: its start and its value."""
    thinks = _spans(text, THINK_START, THINK_END)
    think = next(thinks, None)
    latest: tuple[int, int] | None = None  # the last reasoning that begins before a block
    for start, end in _spans(text, TAG_START, TAG_END):
        while think is not None and think[0] < start:
            latest, think = think, next(thinks, None)
        if latest is not None and end < latest[1]:  # inside it (earlier ones end before)
            continue
        try:
            return start, json_text.loads(text[start + len(TAG_START):end - len(TAG_END)]
                                          .strip())
        except ValueError:
            continue
    return None


def _spans(text: str, opening: str, closing: str) -> Iterator[tuple[int, int]]:
    """``opening(.*?)closing``'s matches, in order: each to the first ``closing`` after it;
    where none follows, no later ``opening`` has one either."""
    pos = 0
    while (start := text.find(opening, pos)) >= 0:
        end = text.find(closing, start + len(opening))
        if end < 0:
            return
        pos = end + len(closing)
        yield start, pos
