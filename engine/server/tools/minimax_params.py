"""The parameters of one MiniMax-M2 call: each ``<parameter name=KEY>VALUE</parameter>``
in its text, as vLLM 0.32's ``_PARAM_RE`` finds them one after another, read forward
without backtracking.

vLLM's pattern: ``<``, blanks, ``parameter``, blanks (one at least), ``name``, blanks,
``=``, blanks, then the key, double-quoted, single-quoted or bare (no ``>`` nor blank),
blanks, ``>``; the value runs, as written, to the first ``</parameter>`` (blanks allowed
inside the tag) or up to the next ``<parameter name=`` (left for the next match). A
quoted key that finds no ``>`` or no end of its value is tried bare. The key is stripped
and an empty one skipped; a later key replaces an earlier one's value in its place.
"""

from __future__ import annotations

from bisect import bisect_left


def parameters(raw: str) -> dict[str, str]:
    """Each key of ``raw``'s parameters and its value as written."""
    ends = _value_ends(raw)
    params: dict[str, str] = {}
    pos = 0
    while (start := raw.find("<", pos)) >= 0:
        found = _match(raw, start, ends)
        if found is None:
            pos = start + 1
            continue
        key, value, pos = found
        if key.strip():
            params[key.strip()] = value
    return params


def _match(raw: str, start: int, ends: list[tuple[int, int]]
           ) -> tuple[str, str, int] | None:
    """The key, value and end of a parameter beginning at ``start``, if one does."""
    at = _word(raw, _blanks(raw, start + 1), "parameter")
    if at < 0 or at == len(raw) or not raw[at].isspace():
        return None
    at = _word(raw, _blanks(raw, at), "name")
    if at < 0:
        return None
    at = _word(raw, _blanks(raw, at), "=")
    if at < 0:
        return None
    at = _blanks(raw, at)
    for key_at, key_end, after in _keys(raw, at):
        close = _word(raw, _blanks(raw, after), ">")
        if close < 0:
            continue
        i = bisect_left(ends, (close, -1))
        if i < len(ends):
            value_end, resume = ends[i]
            return raw[key_at:key_end], raw[close:value_end], resume
    return None


def _keys(raw: str, at: int):
    """Where the key may lie (its text's start and end, and what follows it), in the
    pattern's order: quoted (up to the next same quote), then bare (no ``>`` nor blank)."""
    if at < len(raw) and raw[at] in "\"'":
        close = raw.find(raw[at], at + 1)
        if close >= 0:
            yield at + 1, close, close + 1
    end = at
    while end < len(raw) and raw[end] != ">" and not raw[end].isspace():
        end += 1
    if end > at:
        yield at, end, end


def _value_ends(raw: str) -> list[tuple[int, int]]:
    """Every place a value may end, in order, with where the next match is looked for:
    a ``</parameter>`` tag (after it) or a ``<parameter name=`` (at it)."""
    ends = []
    pos = 0
    while (at := raw.find("<", pos)) >= 0:
        pos = at + 1
        i = _blanks(raw, at + 1)
        if raw.startswith("/", i):
            tag = _word(raw, _blanks(raw, i + 1), "parameter")
            close = -1 if tag < 0 else _word(raw, _blanks(raw, tag), ">")
            if close >= 0:
                ends.append((at, close))
            continue
        tag = _word(raw, i, "parameter")
        if tag < 0 or tag == len(raw) or not raw[tag].isspace():
            continue
        name = _word(raw, _blanks(raw, tag), "name")
        if name >= 0 and _word(raw, _blanks(raw, name), "=") >= 0:
            ends.append((at, at))
    return ends


def _blanks(raw: str, at: int) -> int:
    while at < len(raw) and raw[at].isspace():
        at += 1
    return at


def _word(raw: str, at: int, word: str) -> int:
    """Past ``word`` at ``at``, or -1 when it is not there."""
    return at + len(word) if raw.startswith(word, at) else -1
