"""The rewrites vLLM 0.32's LFM2 parser tries on Python calls that do not parse
(``vllm/tool_parsers/utils.py``), each a no-op on text that already parses: zero-padded
integers unpadded (``month=07``), raw line breaks, tabs and NULs inside strings escaped, a
string broken by quotes of its own kind closed at the one quote after which the text
parses, and parameters named by Python keywords (``from=1``) renamed, then named back.

Each reads the text once, forward; the broken string's repair parses the text once per
place the string may end, as vLLM's does, but at most ``MAX_ENDS_TRIED`` places (more is
taken as ambiguous, left as written: vLLM tries them all, each a parse of the whole text).
"""

from __future__ import annotations

import keyword

from kvledger.engine.server.tools.pythonic_format import parsed

RENAMED = "_pyreservedkw_"
MAX_ENDS_TRIED = 16
_QUOTES = ("'", '"')
_CLOSERS = frozenset(",)]}:")
_ESCAPED = {"\n": "\\n", "\r": "\\r", "\t": "\\t", "\x00": "\\x00"}


def _strings(text: str):
    """Each run of ``text``: (start, end, in a string); a backslash in a string keeps the
    character after it in the string, and a string runs to its next quote of its kind."""
    at, start, quote = 0, 0, None
    while at < len(text):
        char = text[at]
        if quote is None and char in _QUOTES:
            if start < at:
                yield start, at, False
            start, quote = at, char
        elif quote is not None and char == "\\":
            at += 1
        elif char == quote:
            yield start, at + 1, True
            start, quote = at + 1, None
        at += 1
    if start < len(text):
        yield start, len(text), quote is not None


def unpadded_integers(text: str) -> str:
    """Decimal integers outside strings with leading zeros written without them (``07``
    to ``7``; not ``00``, a float's parts, ``0x``...). A ``ValueError`` where Python's
    ``int`` takes no such digits (vLLM's fails there too)."""
    out = []
    for start, end, in_string in _strings(text):
        if in_string:
            out.append(text[start:end])
            continue
        at = start
        while at < end:
            char, run = text[at], at + 1
            if char.isalpha() or char == "_":
                while run < end and (text[run].isalnum() or text[run] == "_"):
                    run += 1
            elif char.isdigit():
                while run < end and (text[run].isdigit() or text[run] == "_"):
                    run += 1
                digits = text[at:run].replace("_", "")
                if digits[0] == "0" and digits.strip("0") and text[at - 1:at] != "." \
                        and text[run:run + 1] not in (".", "e", "E", "j", "J"):
                    out.append(str(int(digits)))
                    at = run
                    continue
            out.append(text[at:run])
            at = run
    return "".join(out)


def escaped_controls(text: str) -> str:
    """Line breaks, tabs and NULs inside strings written as escapes (not one after a
    backslash: that pair stays as written)."""
    out = []
    for start, end, in_string in _strings(text):
        at = start
        while in_string and at < end:
            if text[at] == "\\" and at + 1 < len(text):
                out.append(text[at:at + 2])
                at += 2
                continue
            out.append(_ESCAPED.get(text[at], text[at]))
            at += 1
        if not in_string:
            out.append(text[start:end])
    return "".join(out)


def renamed_keywords(text: str) -> tuple[str, bool]:
    """Parameters named by Python keywords (a keyword after ``(`` or ``,``, then ``=``
    but not ``==``, outside strings) renamed with ``RENAMED`` after them; whether any was."""
    out, changed, last = [], False, ""
    for start, end, in_string in _strings(text):
        if in_string:
            out.append(text[start:end])
            last = text[start]
            continue
        at = start
        while at < end:
            char, run = text[at], at + 1
            if char.isalpha() or char == "_":
                while run < end and (text[run].isalnum() or text[run] == "_"):
                    run += 1
                name, look = text[at:run], run
                while look < len(text) and text[look].isspace():
                    look += 1
                if keyword.iskeyword(name) and text.startswith("=", look) \
                        and not text.startswith("==", look) and last in ("(", ","):
                    name, changed = name + RENAMED, True
                out.append(name)
                last = name[-1]
            else:
                out.append(char)
                last = last if char.isspace() else char
            at = run
    return "".join(out), changed


def named_back(arguments: dict) -> dict:
    """``renamed_keywords``' names undone in a call's arguments."""
    return {k[:-len(RENAMED)] if isinstance(k, str) and k.endswith(RENAMED)
            and keyword.iskeyword(k[:-len(RENAMED)]) else k: v for k, v in arguments.items()}


def closed_nested_quotes(text: str) -> tuple[str, bool]:
    """The first string whose first closing quote is followed (past blanks) by none of
    ``,)]}:`` closed instead at the one such quote after which the text, its quotes of
    that kind inside escaped, parses; whether it was. Text where no string is broken,
    or where none or several places work (or more than ``MAX_ENDS_TRIED``), is returned
    as written."""
    at = 0
    while at < len(text):
        quote = text[at]
        if quote not in _QUOTES:
            at += 1
            continue
        ends = _quotes_after(text, at + 1, quote, first_only=True)
        if not ends:
            return text, False
        if _closes(text, ends[0]):
            at = ends[0] + 1
            continue
        ends = [e for e in _quotes_after(text, at + 1, quote) if _closes(text, e)]
        if len(ends) > MAX_ENDS_TRIED:
            return text, False
        fixed = []
        for end in ends:
            inside = "".join("\\" + c if c == quote and not _escaped(text, j) else c
                             for j, c in enumerate(text[at + 1:end], at + 1))
            candidate = text[:at] + quote + inside + quote + text[end + 1:]
            try:
                parsed(escaped_controls(candidate))
            except (SyntaxError, ValueError):
                continue
            fixed.append(candidate)
        return (fixed[0], True) if len(fixed) == 1 else (text, False)
    return text, False


def _quotes_after(text: str, at: int, quote: str, first_only: bool = False) -> list[int]:
    """Where ``quote`` is in ``text`` from ``at`` on, but after a backslash."""
    found = []
    while at < len(text):
        if text[at] == "\\":
            at += 2
            continue
        if text[at] == quote:
            found.append(at)
            if first_only:
                break
        at += 1
    return found


def _closes(text: str, at: int) -> bool:
    after = at + 1
    while after < len(text) and text[after].isspace():
        after += 1
    return after < len(text) and text[after] in _CLOSERS


def _escaped(text: str, at: int) -> bool:
    """Whether an odd run of backslashes is just before ``at``."""
    run = at
    while run > 0 and text[run - 1] == "\\":
        run -= 1
    return (at - run) % 2 == 1
