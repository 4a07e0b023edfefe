"""phi4_mini_json (Phi-4-mini): the calls as one JSON list after ``functools``, read as
vLLM 0.32's ``Phi4MiniJsonToolParser`` reads a whole answer (``CallScanner`` drives)::

    functools[{"name": "get_weather", "arguments": {"city": "Paris"}}, ...]

vLLM's reading: the first ``functools[`` that some ``]`` follows (where the first has
none, no later one has) makes the answer calls alone, no content: each element an object
with a string ``name`` and ``arguments`` (else ``parameters``), of any JSON type, as
``json.dumps`` writes it; an element otherwise makes the whole answer content. vLLM reads
the list only up to the first ``]``, so a list holding one (an array argument, a string
with a ``]``) is no JSON to it, and its answer is then empty: no content, no call.
kvledger reads the list to its own closing bracket instead (a deliberate difference: the
grammar of ``tool_choice: "required"`` may write arrays), and where that is no JSON either,
answers as vLLM does.

vLLM streams nothing of this parser's answers; kvledger streams the content before
``functools[`` as it is written (which the whole answer drops when a call follows), and
the rest at the end (``read_at_end``).
"""

from __future__ import annotations

import json

from kvledger.engine.server.tools.call_json import loose_call
from kvledger.engine.server.tools.call_pieces import Piece, read_at_end

FUNCTOOLS = "functools["
_KEYS = ("arguments", "parameters")


def phi4_mini_json(scanner, text: str, final: bool) -> list[Piece]:
    return read_at_end(scanner, text, final, (FUNCTOOLS,), read)


def read(text: str) -> tuple[str, list[tuple[str, str]]]:
    """The whole answer's content and calls, as vLLM reads them (a list holding a ``]``
    read whole)."""
    start = text.find(FUNCTOOLS)
    close = -1 if start < 0 else text.find("]", start + len(FUNCTOOLS))
    if close < 0:
        return text, []
    opening = start + len(FUNCTOOLS) - 1
    try:
        values, _ = json.JSONDecoder().raw_decode(text, opening)
    except (ValueError, RecursionError):  # no list of its own: vLLM's reading
        try:
            values = json.loads(text[opening:close + 1])
        except json.JSONDecodeError:  # (vLLM logs it and makes no call, and no content)
            return "", []
        except (ValueError, RecursionError):  # (vLLM's parser fails: all content)
            return text, []
    calls = []
    for value in values:
        call = loose_call(value, _KEYS)
        if call is None:
            return text, []
        calls.append(call)
    return "", calls
