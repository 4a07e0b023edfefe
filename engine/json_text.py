"""JSON from outside (files, hub replies, request fields, model output) parsed with one
rule: a text nested deeper than the parser can recurse is a ``ValueError`` like any other
malformed JSON, never a ``RecursionError``, so each caller's ``except ValueError`` turns
it into its own clear refusal (a 4xx, or one ``error:`` line) instead of a traceback."""

from __future__ import annotations

import json
from typing import Any


class NestedTooDeeply(ValueError):
    def __init__(self) -> None:
        super().__init__("JSON nested too deeply")


def loads(text: str | bytes, **kwargs: Any) -> Any:
    """``json.loads(text, **kwargs)``; NestedTooDeeply (a ValueError) for a text nested
    past the interpreter's recursion limit."""
    try:
        return json.loads(text, **kwargs)
    except RecursionError:
        raise NestedTooDeeply() from None
