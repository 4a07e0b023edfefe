"""The parts of a Responses request that are objects of their own: a function tool in the
Responses API's flat shape (and its chat shape), a named ``tool_choice``, ``text.format``
(and the ``response_format`` it is), ``reasoning`` and ``stream_options``. Each holds
the fields OpenAI's SDK sends; those that change nothing here say why.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, model_validator

from kvledger.engine.server.chat_options import ReasoningEffort
from kvledger.engine.server.limits import shown
from kvledger.engine.server.validation import Refusal, Strict

# OpenAI's limits on ``metadata``. It changes nothing here but is echoed in each response
# object (a stream's three), so 100,000 keys held the event loop 0.3 s to write them.
MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512


def _metadata_within_limits(value: Any) -> Any:
    """``metadata`` counted and measured before it is validated (a non-object is left to
    the type's own error)."""
    if not isinstance(value, dict):
        return value
    if len(value) > MAX_METADATA_PAIRS:
        raise Refusal(f"'metadata' holds {len(value)} pairs; at most {MAX_METADATA_PAIRS} "
                      f"are allowed (OpenAI's limit)", "metadata")
    for key, item in value.items():
        if len(key) > MAX_METADATA_KEY_CHARS:
            raise Refusal(f"'metadata' key {shown(key)} is longer than "
                          f"{MAX_METADATA_KEY_CHARS} characters (OpenAI's limit)", "metadata")
        if isinstance(item, str) and len(item) > MAX_METADATA_VALUE_CHARS:
            raise Refusal(f"'metadata' value of {shown(key)} is longer than "
                          f"{MAX_METADATA_VALUE_CHARS} characters (OpenAI's limit)",
                          "metadata")
    return value


Metadata = Annotated[dict[str, str], BeforeValidator(_metadata_within_limits)]


class FunctionTool(Strict):
    """A function tool, in the Responses API's flat shape."""

    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def as_chat(self) -> dict[str, Any]:
        function = self.model_dump(exclude={"type"}, exclude_none=True)
        return {"type": "function", "function": function}


class NamedFunction(Strict):
    type: Literal["function"]
    name: str


class TextFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> TextFormat:
        if self.type == "json_schema" and self.schema_ is None:
            raise Refusal("a 'json_schema' format needs its 'schema'", "text.format.schema")
        return self

    def as_response_format(self) -> dict[str, Any]:
        """Chat's ``response_format`` for this format."""
        if self.type != "json_schema":
            return {"type": self.type}
        schema = {"name": self.name or "response", "schema": self.schema_,
                  "description": self.description, "strict": self.strict}
        return {"type": "json_schema",
                "json_schema": {k: v for k, v in schema.items() if v is not None}}


class TextConfig(Strict):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # no model here reads it


class Reasoning(Strict):
    effort: ReasoningEffort | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None  # no reasoning parser
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class StreamOptions(Strict):
    include_obfuscation: bool | None = None  # no obfuscation padding is sent
