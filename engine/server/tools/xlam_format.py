"""xlam (Salesforce xLAM): a JSON list of calls, bare, in a code fence, after
``[TOOL_CALLS]`` or in ``<tool_call>`` tags, read as vLLM 0.32's ``xLAMToolParser`` reads
a whole answer (``CallScanner`` drives)::

    [{"name": "get_weather", "arguments": {"city": "Paris"}}]

vLLM's reading: the text after the first ``</think>``, stripped, when it is JSON (the
content then the text up to that tag, stripped), else the first of its matches of a
fenced block, a ``[TOOL_CALLS]`` line and a ``<tool_call>`` element (in that order of
kinds) that is JSON; else the same in the whole answer (the content then the answer less
every match of that kind, stripped); else the whole answer when it begins ``[`` (blanks
before it aside) and is JSON or holds ``{``, ``name`` and ``arguments`` (no content).
That JSON, when a list, makes a call of each object with ``name`` and ``arguments``
(arguments that are an object as ``json.dumps`` writes it, a string as written); a name
or arguments of another type, or no JSON at all, makes the whole answer content. Each
match is found as vLLM's lazy patterns find them, reading forward without backtracking.

The stream gives out the content up to the first of those markers as it is written
(unless the answer begins blank or with ``[``: its content is then held), and the rest,
calls and content, at the end, where any later text may still change the reading.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator

from kvledger.engine.server.tools.call_json import regex_space
from kvledger.engine.server.tools.call_pieces import Piece, read_at_end

THINK_END, FENCE, TOOL_CALLS = "</think>", "```", "[TOOL_CALLS]"
TAG_START, TAG_END = "<tool_call>", "</tool_call>"
MARKERS = (FENCE, TOOL_CALLS, TAG_START, THINK_END)

Match = tuple[int, int, str]  # the match's start and end, its group


def xlam(scanner, text: str, final: bool) -> list[Piece]:
    return read_at_end(scanner, text, final, MARKERS, read,
                       hold=lambda t: t[0].isspace() or t[0] == "[")


def read(text: str) -> tuple[str, list[tuple[str, str]]]:
    """The whole answer's content and calls, as vLLM reads them."""
    try:
        content, found = _found(text)
        if found is None:
            return content, []
        data = json.loads(found)
    except (ValueError, RecursionError):  # vLLM's parser fails: the answer is content
        return text, []
    if not isinstance(data, list):
        return content or text, []
    calls = []
    for call in data:
        if not isinstance(call, dict) or "name" not in call or "arguments" not in call:
            continue
        name, arguments = call["name"], call["arguments"]
        if isinstance(arguments, dict):
            arguments = json.dumps(arguments, ensure_ascii=False)
        if not isinstance(name, str) or not isinstance(arguments, str):
            return text, []  # vLLM's call fails its own validation: all content
        calls.append((name, arguments))
    return content, calls


def _found(text: str) -> tuple[str, str | None]:
    """vLLM's ``preprocess_model_output``: the content, and the text read as calls."""
    think = text.find(THINK_END)
    if think >= 0:
        after = text[think + len(THINK_END):].strip()
        before = text[:think + len(THINK_END)].strip()
        if _json(after):
            return before, after
        for kind in KINDS:
            json_text = next((g for _, _, g in kind(after) if _json(g)), None)
            if json_text is not None:
                return before, json_text
    for kind in KINDS:
        matches = list(kind(text))
        json_text = next((g for _, _, g in matches if _json(g)), None)
        if json_text is not None:
            return _without(text, matches).strip(), json_text
    if text.strip().startswith("[") and (
            _json(text) or all(w in text for w in ("{", "name", "arguments"))):
        return "", text
    return text, None


def _json(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:  # (only this: vLLM's parser fails on any other error)
        return False
    return True


def _without(text: str, matches: list[Match]) -> str:
    parts, pos = [], 0
    for start, end, _ in matches:
        parts.append(text[pos:start])
        pos = end
    return "".join(parts) + text[pos:]


def _fences(text: str) -> Iterator[Match]:
    """```(?:json)?\\s*([\\s\\S]*?)``` : a group runs to the next fence after the
    blanks; where none follows, no later fence has one either."""
    pos = 0
    while (start := text.find(FENCE, pos)) >= 0:
        at = start + len(FENCE)
        at += 4 if text.startswith("json", at) else 0
        while at < len(text) and regex_space(text[at]):
            at += 1
        end = text.find(FENCE, at)
        if end < 0:
            return
        yield start, end + len(FENCE), text[at:end]
        pos = end + len(FENCE)


def _lines(text: str) -> Iterator[Match]:
    """\\[TOOL_CALLS\\]([\\s\\S]*?)(?=\\n|$) : the rest of the marker's line."""
    pos = 0
    while (start := text.find(TOOL_CALLS, pos)) >= 0:
        at = start + len(TOOL_CALLS)
        end = text.find("\n", at)
        end = len(text) if end < 0 else end
        yield start, end, text[at:end]
        pos = end


def _tags(text: str) -> Iterator[Match]:
    """<tool_call>([\\s\\S]*?)</tool_call> : to the first closing tag."""
    pos = 0
    while (start := text.find(TAG_START, pos)) >= 0:
        end = text.find(TAG_END, start + len(TAG_START))
        if end < 0:
            return
        yield start, end + len(TAG_END), text[start + len(TAG_START):end]
        pos = end + len(TAG_END)


KINDS: tuple[Callable[[str], Iterator[Match]], ...] = (_fences, _lines, _tags)
