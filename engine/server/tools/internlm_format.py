"""internlm (InternLM2, InternLM2.5): each call a JSON object after
``<|action_start|><|plugin|>``, up to ``<|action_end|>`` (special tokens of InternLM's
tokenizer: ``CONTROL_TOKENS``), read as vLLM 0.32's ``Internlm2ToolParser`` reads a whole
answer (``CallScanner`` drives)::

    Let me check.<|action_start|><|plugin|>
    {"name": "get_weather", "parameters": {"city": "Paris"}}<|action_end|>

vLLM's reading of a call: its text up to ``<|action_end|>`` (or the answer's end), from
its first ``{`` (without one, its last character), is one JSON object with a string
``name``; its arguments are its ``parameters``, else its ``arguments``, else ``{}``, as
``json.dumps`` writes them. The content is the text before the first call; text after a
call is no content.

Where vLLM's parser raises (an error answer), kvledger answers: a call it cannot read
makes the whole answer content, and a second ``<|action_start|><|plugin|>`` begins a
second call (InternLM's chat template writes a message's calls so, one after another),
where vLLM's reads one call only.

The stream gives out the content before the first call as it is written, and the calls at
the end: any later call that cannot be read makes the answer content.
"""

from __future__ import annotations

from typing import Any

from kvledger.engine import json_text
from kvledger.engine.server.tools.call_json import dumped
from kvledger.engine.server.tools.call_pieces import Piece, read_at_end

ACTION_START, PLUGIN, ACTION_END = "<|action_start|>", "<|plugin|>", "<|action_end|>"
CALL_START = ACTION_START + PLUGIN
MARKERS = (ACTION_START, PLUGIN, ACTION_END)


def internlm(scanner, text: str, final: bool) -> list[Piece]:
    return read_at_end(scanner, text, final, (CALL_START,), read_internlm)


def read_internlm(text: str) -> tuple[str, list[tuple[str, str]]]:
    """The whole answer as vLLM reads it: the content before the first call and the calls,
    or all of it content when a call cannot be read (where vLLM's parser fails)."""
    start = text.find(CALL_START)
    if start < 0:
        return text, []
    calls = []
    for part in text[start + len(CALL_START):].split(CALL_START):
        call = _call(part)
        if call is None:
            return text, []
        calls.append(call)
    return text[:start], calls


def _call(part: str) -> tuple[str, str] | None:
    """The call written in ``part`` (the text after its marker), or None."""
    end = part.find(ACTION_END)
    action = part if end < 0 else part[:end]
    brace = action.find("{")
    try:
        value: Any = json_text.loads(action[brace:] if brace >= 0 else action[-1:])
    except ValueError:
        return None
    if not (isinstance(value, dict) and isinstance(value.get("name"), str)):
        return None
    arguments = dumped(value.get("parameters", value.get("arguments", {})))
    return None if arguments is None else (value["name"], arguments)
