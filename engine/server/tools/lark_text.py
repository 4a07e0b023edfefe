"""Pieces of the Lark grammars (llguidance's dialect) that constrain tool calls: text as
literals (a tokenizer's special tokens in it as those very tokens), rules from parts,
and a JSON value of a schema laid out as ``json.dumps`` writes it."""

from __future__ import annotations

import json
import re
from typing import Any


def lark(text: str, specials: dict[str, int]) -> str:
    """``text`` as a Lark sequence: string literals (JSON's escapes are Lark's), and each
    special token in it as a reference to that token (``<[id]>``); "" for no text."""
    if not specials:
        return json.dumps(text) if text else ""
    pattern = "(" + "|".join(re.escape(m) for m in sorted(specials, key=len, reverse=True)) + ")"
    parts = re.split(pattern, text)
    return " ".join(f"<[{specials[p]}]>" if p in specials else json.dumps(p) for p in parts if p)


def rule(*parts: str) -> str:
    return " ".join(p for p in parts if p)


# The arguments laid out as json.dumps writes them: a model with weak weights cannot pad
# them with whitespace until max_tokens (llguidance allows any by default).
ARGUMENTS_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ",
                    "key_separator": ": "}


def json_value(schema: Any) -> str:
    """The Lark body of a JSON value ``schema`` accepts (``%json``)."""
    layout = {"x-guidance": ARGUMENTS_LAYOUT}
    body = {**layout, **schema} if isinstance(schema, dict) else \
        {**layout, "allOf": [schema]}
    return "%json " + json.dumps(body, sort_keys=True)
