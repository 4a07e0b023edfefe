"""Logprobs in OpenAI's two shapes, from the engine's ``TokenLogprobs``.

Completions (the legacy shape): parallel lists ``tokens``, ``token_logprobs``,
``top_logprobs`` (a ``{token: logprob}`` map holding the chosen token and the top k, as
vLLM returns it) and ``text_offset``. Chat: one entry per token with its ``bytes`` and
the top k as a list. A logprob too small for float32 (``-inf``) is sent as -9999.0, as
vLLM does: JSON has no infinity.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

FLOOR = -9999.0

# (token id, its TokenLogprobs or None for a prompt's first token)
Entry = tuple[int, Any]
TokenText = Callable[[int], str]


def _value(logprob: float) -> float:
    return logprob if logprob > FLOOR else FLOOR


def completion_logprobs(entries: Iterable[Entry], token_text: TokenText,
                        offset: int = 0) -> dict[str, list]:
    """The completions ``logprobs`` object for ``entries``; ``offset`` is where the first
    token's text starts in the choice's text."""
    tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
    for token_id, lp in entries:
        text = token_text(token_id)
        tokens.append(text)
        text_offset.append(offset)
        offset += len(text)
        if lp is None:
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        token_logprobs.append(_value(lp.logprob))
        top = {token_text(t): _value(v) for t, v in lp.top}
        top.setdefault(text, _value(lp.logprob))
        top_logprobs.append(top)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": text_offset}


def chat_logprobs(entries: Iterable[Entry], token_text: TokenText) -> dict[str, Any]:
    """The chat ``logprobs`` object: ``{"content": [...], "refusal": None}``."""
    return {"content": [_chat_entry(token_id, lp.logprob, token_text,
                                    [_chat_entry(t, v, token_text) for t, v in lp.top])
                        for token_id, lp in entries],
            "refusal": None}


def _chat_entry(token_id: int, logprob: float, token_text: TokenText,
                top: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    text = token_text(token_id)
    entry = {"token": text, "logprob": _value(logprob), "bytes": list(text.encode())}
    if top is not None:
        entry["top_logprobs"] = top
    return entry
