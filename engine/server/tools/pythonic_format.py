"""pythonic (Llama 3.2, Llama 4, ToolACE) and llama4_pythonic: the answer is a Python
list of calls with keyword arguments, ``[get_weather(city="Paris"), get_time()]``.

Read as vLLM 0.32 reads a whole answer (``PythonicToolParser.extract_tool_calls``): the
text must start with ``[`` and match its pattern (``_looks_like_calls``, the same test as
its regex, without the regex's backtracking), then parse as Python whose first statement
is a list of calls; each call's name (dotted names too) and keyword arguments, literals
made JSON (``true``/``false``/``null`` as well, tuples and sets as lists, ``-1``), are a
call. Anything else (a leading space, a positional argument, text after the list that
is not Python) makes the whole answer content. llama4_pythonic first drops a leading
``<|python_start|>`` and every ``<|python_end|>``.

olmo3 (OLMo 3) writes the same calls one a line, in ``<function_calls>``...
``</function_calls>``, read as vLLM 0.32's ``Olmo3PythonicToolParser`` reads a whole
answer: the first such block's text (else the whole answer) has its non-blank lines,
stripped, joined by ``, `` in ``[``...``]``, and that list is read as pythonic's. An
answer that begins (after blanks) with neither ``name(`` nor the block's tag streams as
content up to the tag (vLLM's stream sends all of it; its whole answer drops it when the
block holds calls).

So whether an answer that starts ``[name(`` holds calls is known only at its end: it goes
out then, calls or content (vLLM's stream sends it as calls while it is written, and
never as content, even when its whole answer is content). Any other answer is content as
it is written.
"""

from __future__ import annotations

import ast
import json
import re
import unicodedata
import warnings
from typing import Any

from kvledger.engine.server.tools.call_pieces import Piece, content_until, whole_calls

PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"
FUNCTION_CALLS, FUNCTION_CALLS_END = "<function_calls>", "</function_calls>"
# vLLM's pattern matches with the `regex` module, whose \s is Unicode's White_Space:
REGEX_SPACES = frozenset("\t\n\x0b\x0c\r \x85\xa0\u1680\u2028\u2029\u202f\u205f\u3000"
                    + "".join(map(chr, range(0x2000, 0x200B))))
_LIST_END = re.compile(r"\)[" + re.escape("".join(sorted(REGEX_SPACES))) + r"]*\]")
# ... and whose \w also takes the letters drawn in circles and squares (Other_Alphabetic).
_ALPHABETIC_SYMBOLS = ((0x24B6, 0x24E9), (0x1F130, 0x1F149), (0x1F150, 0x1F169),
                       (0x1F170, 0x1F189))
_JSON_NAMES = {"null": None, "true": True, "false": False}


def pythonic(scanner, text: str, final: bool) -> list[Piece]:
    return _read(scanner, text, final, llama4=False)


def llama4_pythonic(scanner, text: str, final: bool) -> list[Piece]:
    return _read(scanner, text, final, llama4=True)


def _read(scanner, text: str, final: bool, llama4: bool) -> list[Piece]:
    if scanner.mode == "start":
        maybe = _may_be_calls(text, llama4)
        if maybe is None and not final:
            return []
        scanner.mode = "content" if maybe is False else "calls"
    if scanner.mode == "content":
        piece, scanner.pos = text[scanner.pos:], len(text)
        return [piece] if piece else []
    if not final:
        return []
    calls = answer_calls(text, llama4)
    scanner.pos = len(text)
    return [text] if calls is None else whole_calls(scanner, calls)


def olmo3(scanner, text: str, final: bool) -> list[Piece]:
    out: list[Piece] = []
    if scanner.mode == "start":  # blanks, then a name: calls if a '(' follows it
        at, name = scanner.state or (0, False)  # (read on from where the last feed stopped)
        while at < len(text) and (_word(text[at]) if name else text[at].isspace()):
            at += 1
        if not name and at < len(text) and text[at].isascii() and text[at].isalpha():
            name, at = True, _name_end(text, at) or at
        if at == len(text) and not final:
            scanner.state = (at, name)
            return out
        scanner.mode = "calls" if name and text.startswith("(", at) else "content"
        scanner.state = None
    if scanner.mode == "content":  # calls only from a block's tag on
        if content_until(scanner, text, (FUNCTION_CALLS,), final, out) is None:
            return out
        scanner.mode = "calls"
    if final:
        calls = olmo3_calls(text)
        out += [text[scanner.pos:]] if calls is None else whole_calls(scanner, calls)
        scanner.pos = len(text)
    return out


def olmo3_calls(text: str) -> list[tuple[str, str]] | None:
    """The calls (names, JSON arguments) a whole olmo3 answer holds, or None: content."""
    start = text.find(FUNCTION_CALLS)
    if start >= 0:
        end = text.find(FUNCTION_CALLS_END, start + len(FUNCTION_CALLS))
        if end >= 0:
            text = text[start + len(FUNCTION_CALLS):end].strip()
    lines = (line.strip() for line in text.splitlines())
    return answer_calls("[" + ", ".join(line for line in lines if line) + "]")


def _may_be_calls(text: str, llama4: bool) -> bool | None:
    """Whether ``text`` so far may be the start of calls (None: too little to tell)."""
    if llama4 and text.startswith(PYTHON_START):
        return True
    if llama4 and PYTHON_START.startswith(text):
        return None
    if not text:
        return None
    if text[0] != "[":
        return False
    end = _name_end(text, 1)
    if end is None:  # no letter after the '[' (yet)
        return None if len(text) == 1 else False
    return None if end == len(text) else text[end] == "("


def answer_calls(text: str, llama4: bool = False) -> list[tuple[str, str]] | None:
    """The calls (names, JSON arguments) a whole answer holds, or None: it is content."""
    if llama4 and text.startswith(PYTHON_START):
        text = text[len(PYTHON_START):].replace(PYTHON_END, "")
    if not _looks_like_calls(text):
        return None
    try:
        return module_calls(parsed(text))
    except Exception:  # vLLM's: whatever fails, the answer is text
        return None


def parsed(source: str) -> ast.Module:
    """``source`` parsed as Python (its warnings, of escapes say, silenced)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return ast.parse(source)


def module_calls(module: ast.Module) -> list[tuple[str, str]] | None:
    """The calls of a module whose first statement is a list of calls, or None; a
    ``ValueError`` for a call that is not a name with literal keyword arguments."""
    value = getattr(module.body[0], "value", None)
    if not (isinstance(value, ast.List) and all(isinstance(e, ast.Call) for e in value.elts)):
        return None
    return [_call(e) for e in value.elts]


def _looks_like_calls(text: str) -> bool:
    """vLLM's TOOL_CALL_REGEX matched at the start: ``[``, calls ``name(`` with no
    arguments (``),`` between them, or ``)`` then only more such calls) up to ``)]``, or
    a call whose first argument is ``name=`` and any text after, then ``)`` ``]``."""
    if not text.startswith("["):
        return False
    at, last_only = 1, False
    while True:
        end = _name_end(text, at)
        if end is None or not text.startswith("(", end):
            return False
        argument = _name_end(text, end + 1)
        if argument is not None and text.startswith("=", argument):
            return _LIST_END.search(text, argument + 1) is not None
        if not text.startswith(")", end + 1):
            return False
        after = end + 2
        if text.startswith(",", after) and not last_only:
            at = _skip_space(text, after + 1)
            continue
        at = _skip_space(text, after)
        if text.startswith("]", at):
            return True
        last_only = True


def _name_end(text: str, at: int) -> int | None:
    """The end of the pattern's name (an ASCII letter, then word characters) at ``at``."""
    if at >= len(text) or not (text[at].isascii() and text[at].isalpha()):
        return None
    at += 1
    while at < len(text) and _word(text[at]):
        at += 1
    return at


def _word(char: str) -> bool:
    category = unicodedata.category(char)
    return (category[0] in "LM" or category in ("Nd", "Nl", "Pc") or char in "\u200c\u200d"
            or any(low <= ord(char) <= high for low, high in _ALPHABETIC_SYMBOLS))


def _skip_space(text: str, at: int) -> int:
    while at < len(text) and text[at] in REGEX_SPACES:
        at += 1
    return at


def _call(call: ast.Call) -> tuple[str, str]:
    parts, node = [], call.func
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        raise ValueError("not a function's name")
    arguments = {k.arg: _value(k.value) for k in call.keywords}
    return ".".join([node.id, *reversed(parts)]), json.dumps(arguments, ensure_ascii=False)


def _value(node: ast.expr) -> Any:
    """A literal argument as JSON takes it (vLLM's ``get_parameter_value``)."""
    if isinstance(node, ast.Constant):
        if node.value is None or isinstance(node.value, (str, int, float)):
            return node.value
    elif isinstance(node, ast.Dict):
        if all(isinstance(k, ast.Constant) for k in node.keys):
            return {k.value: _value(v) for k, v in zip(node.keys, node.values, strict=True)}
    elif isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        return [_value(v) for v in node.elts]
    elif isinstance(node, ast.JoinedStr) and all(isinstance(p, ast.Constant) for p in node.values):
        return "".join(str(p.value) for p in node.values)
    elif isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        operand = _value(node.operand)
        if isinstance(operand, (int, float)) and not isinstance(operand, bool):
            return -operand if isinstance(node.op, ast.USub) else operand
    raise ValueError("not a literal")
