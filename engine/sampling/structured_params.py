"""``StructuredOutputsParams``: vLLM 0.32's offline form of an output constraint,
``SamplingParams(structured_outputs=StructuredOutputsParams(json=schema))``, with its
fields: exactly one constraint (``json``, ``regex``, ``choice``, ``grammar``,
``json_object``, ``structural_tag``) and the JSON layout options this request gives for
itself. ``LLM.generate`` compiles it at the engine's door, as the server compiles a
request's ``structured_outputs`` (both read as ``GrammarSpec``'s kind, value, layout).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kvledger.engine import json_text
from kvledger.engine.errors import BadInput
from kvledger.engine.sampling.json_grammar import JsonLayout

_CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """One constraint and the layout options, vLLM's names; BadInput unless exactly one
    constraint is given."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | dict | None = None

    def __post_init__(self) -> None:
        given = [name for name in _CONSTRAINTS if getattr(self, name) is not None]
        if len(given) != 1:
            raise BadInput(f"structured_outputs needs exactly one of {', '.join(_CONSTRAINTS)}"
                           f", got {', '.join(given) or 'none'}")

    def constraint(self) -> tuple[str, str | None, JsonLayout | None]:
        """``(kind, value, layout)``: ``GrammarSpec``'s fields (a schema as sorted JSON,
        so equal ones share a compile)."""
        layout = JsonLayout(self.disable_any_whitespace, self.disable_additional_properties,
                            self.whitespace_pattern)
        layout = None if layout == JsonLayout() else layout
        if self.json is not None:
            return "json_schema", _json_text(self.json, "json"), layout
        if self.structural_tag is not None:
            return "structural_tag", _json_text(self.structural_tag, "structural_tag"), layout
        if self.choice is not None:
            return "choice", json.dumps(list(self.choice)), layout
        if self.regex is not None:
            return "regex", self.regex, layout
        if self.grammar is not None:
            return "grammar", self.grammar, layout
        return "json_object", None, layout


def _json_text(value: Any, name: str) -> str:
    if isinstance(value, str):
        try:
            value = json_text.loads(value)
        except ValueError as exc:
            raise BadInput(f"structured_outputs {name}: not JSON ({exc})") from None
    try:
        return json.dumps(value, sort_keys=True, separators=(",", ":"))
    except (TypeError, ValueError) as exc:
        raise BadInput(f"structured_outputs {name}: not JSON ({exc})") from None
