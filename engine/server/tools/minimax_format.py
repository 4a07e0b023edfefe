"""minimax_m2 (MiniMax-M2): calls as ``<invoke>`` tags whose parameter values are bare
text, typed by the request's tool schema, read as the text grows (``CallScanner`` drives)::

    <minimax:tool_call>
    <invoke name="get_weather">
    <parameter name="city">Paris</parameter>
    </invoke>
    </minimax:tool_call>

Read as vLLM 0.32's ``MinimaxM2Parser`` (its parser engine) reads a whole answer with no
reasoning parser beside it (``<think>`` is text). The text is cut into its markers, the
longest at each place first (``<invoke name="``, ``<invoke name='``, ``<invoke name=``,
``">``, ``'>``, ``>``, ``<parameter name=``, ``</parameter>``, ``</invoke>``, the two
wrapper tags, ``<think>``, ``</think>``), each read by where the reader is:

- in content: text is content; ``<minimax:tool_call>`` leads into the calls (text there
  is dropped), ``</minimax:tool_call>`` is dropped, an ``<invoke name=`` opens a call;
- in the calls (and between calls): an ``<invoke name=`` opens a call, the closing
  wrapper tag goes back to content, all else is dropped;
- in a call's name: text up to any of ``">``, ``'>``, ``>``, then its arguments' text up
  to ``</invoke>`` (or the text's end), where the call is read (``minimax_params``).

A call is made when its name, stripped, is one of the request's tools (any name when it
declares none); with no name, the first ``"name": "..."`` in its text names it, else its
text read as a JSON object's ``name`` and ``arguments``. Values are typed by the tool's
schema (``schema_types``, the owner qwen3_coder's share). The content is the text before
the first ``<invoke``, and after it too unless a call's name was taken as written;
stripped when a call is made, dropped when only blank.

The stream adds up to that whole answer: content before the first call goes out as it
comes unless it begins blank (then held until a call settles it, or the end); content
after it is held to the end (or dropped once it must be); each call goes out whole when
it ends.
"""

from __future__ import annotations

import json
import re

from kvledger.engine.server.tools.call_pieces import Arguments, Piece, ToolCall
from kvledger.engine.server.tools.kimi_format import name_field
from kvledger.engine.server.tools.minimax_params import parameters
from kvledger.engine.server.tools.schema_types import coerced

CALLS_START, CALLS_END = "<minimax:tool_call>", "</minimax:tool_call>"
INVOKES = ('<invoke name="', "<invoke name='", "<invoke name=")
NAME_ENDS = ('">', "'>", ">")
INVOKE_END = "</invoke>"
PARAM_START, PARAM_END = "<parameter name=", "</parameter>"
MARKERS = (CALLS_START, CALLS_END)
_LITERALS = (CALLS_START, CALLS_END, *INVOKES, *NAME_ENDS, INVOKE_END, PARAM_START,
             PARAM_END, "<think>", "</think>")
_BY_FIRST = {c: sorted((m for m in _LITERALS if m[0] == c), key=len, reverse=True)
             for c in {m[0] for m in _LITERALS}}
_FIRST = re.compile("[<>\"']")  # one character class: no backtracking


class _Reading:
    """Where the reader is, the call being read, and the content not yet given out."""

    def __init__(self) -> None:
        self.where = "content"  # content | calls | name | args
        self.name: list[str] = []
        self.args: list[str] = []
        self.invoked = False  # an <invoke was read: content after it is "after"
        self.made = False  # a call was made
        self.as_written = False  # a call's name was taken as written: "after" dropped
        self.before: list[str] = []
        self.given: list[str] = []  # the content given out so far
        self.held = False  # the content before the first call begins blank
        self.after: list[str] = []


def minimax_m2(scanner, text: str, final: bool) -> list[Piece]:
    if scanner.mode == "start":
        scanner.mode, scanner.state = "reading", _Reading()
    r: _Reading = scanner.state
    out: list[Piece] = []
    pos = scanner.pos
    while pos < len(text):
        m = _FIRST.search(text, pos)
        stop = m.start() if m else len(text)
        if stop > pos:
            _text(r, text[pos:stop], out)
        pos = stop
        if m is None:
            break
        marker = _marker_at(text, stop, final)
        if marker is None:  # the text's end may yet become a longer marker
            break
        if marker:
            _marker(scanner, r, marker, out)
            pos += len(marker)
        else:
            _text(r, text[stop], out)
            pos += 1
    scanner.pos = pos
    if final:
        if r.where in ("name", "args"):
            out += _call(scanner, r)
        out += _content_at_end(r)
    return out


def _marker_at(text: str, at: int, final: bool) -> str | None:
    """The longest marker at ``at`` ("" when none), None while the text's end there may
    yet grow into one."""
    rest = len(text) - at
    candidates = _BY_FIRST[text[at]]
    if not final and any(len(m) > rest and m.startswith(text[at:]) for m in candidates):
        return None
    return next((m for m in candidates if text.startswith(m, at)), "")


def _marker(scanner, r: _Reading, marker: str, out: list[Piece]) -> None:
    if r.where in ("content", "calls") and marker in INVOKES:
        r.where, r.invoked, r.name, r.args = "name", True, [], []
    elif r.where in ("content", "calls") and marker in (CALLS_START, CALLS_END):
        r.where = "calls" if marker == CALLS_START else "content"
    elif r.where == "name" and marker in NAME_ENDS:
        r.where = "args"
    elif r.where == "args" and marker == INVOKE_END:
        out += _call(scanner, r)
        r.where = "calls"
    else:
        _text(r, marker, out)


def _text(r: _Reading, text: str, out: list[Piece]) -> None:
    if r.where == "name":
        r.name.append(text)
    elif r.where == "args":
        r.args.append(text)
    elif r.where == "content" and r.invoked:
        if not r.as_written:
            r.after.append(text)
    elif r.where == "content":
        if not r.before and not r.given and text[0].isspace():
            r.held = True
        if r.held:
            r.before.append(text)
        else:
            r.given.append(text)
            out.append(text)


def _call(scanner, r: _Reading) -> list[Piece]:
    """The call read (its name and text), made or not as vLLM's engine makes it."""
    name, raw = "".join(r.name), "".join(r.args)
    if not name and raw:
        found = name_field(raw)
        name = found if found and scanner.declares(found) else ""
    r.as_written = r.as_written or (bool(name) and scanner.declares(name))
    name = name.strip()
    if not name and raw.strip():
        name, values = _json_call(raw)
    else:
        values = parameters(raw)
    if not name or not scanner.declares(name):
        return []
    properties = scanner.properties(name)
    if isinstance(values, dict):
        values = {k: coerced(v, properties[k]) if k in properties and isinstance(v, str)
                  else v for k, v in values.items()}
        values = json.dumps(values, ensure_ascii=False)
    r.made = True
    call = ToolCall(name, id=scanner.new_id())
    return [*_settled(r), call, Arguments(call, values)]


def _settled(r: _Reading) -> list[Piece]:
    """The held content before the first call, once a call is made and no text after it
    can join it (a name taken as written): stripped, given out before the call."""
    if not (r.as_written and r.before):
        return []
    before = "".join(r.before).strip()
    r.before = []
    if before:
        r.given.append(before)
    return [before] if before else []


def _json_call(raw: str) -> tuple[str, dict | str]:
    """A call with no name whose text is a JSON object: its ``name``, and its
    ``arguments`` (or ``parameters``; else the object without its name)."""
    try:
        body = json.loads(raw.strip())
    except ValueError:
        return "", {}
    if not isinstance(body, dict) or not isinstance(body.get("name"), str):
        return "", {}
    for key in ("arguments", "parameters"):
        if key in body:
            value = body[key]
            return body["name"], value if isinstance(value, (str, dict)) else \
                json.dumps(value, ensure_ascii=False)
    return body["name"], {k: v for k, v in body.items() if k != "name"}


def _content_at_end(r: _Reading) -> list[Piece]:
    """What is left of the content once the answer is whole."""
    given = "".join(r.given)
    content = given + "".join(r.before) + ("" if r.as_written else "".join(r.after))
    if r.made:
        content = content.strip()
    if r.invoked and not content.strip():
        content = ""
    # (what was given out began the content: at most its trailing blanks are cut now)
    return [content[len(given):]] if len(content) > len(given) else []
