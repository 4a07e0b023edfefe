"""OpenAI's tool-calling fields of a chat request, as pydantic models: ``tools`` (function
definitions with JSON-schema ``parameters``), ``tool_choice``, ``parallel_tool_calls``, and
the assistant ``calls`` and ``tool_call_id`` a conversation sends back.

``check_tool_choice`` owns the rules that need no model: a ``tool_choice`` needs ``tools``;
a named function must be declared; no tools means ``"none"``, tools without a choice mean
``"auto"`` (vLLM's defaults). Whether the server may answer ``"auto"`` is the server's
rule (``tool_calls.tool_plan``).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator

from kvledger.engine import json_text
from kvledger.engine.server.limits import shown
from kvledger.engine.server.validation import Refusal, Strict

MAX_TOOLS = 128  # OpenAI's limit
_FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")  # OpenAI's, plus vLLM's '.' and ':'


class FunctionDefinition(Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("name")
    @classmethod
    def _name(cls, name: str) -> str:
        if not _FUNCTION_NAME.match(name):
            raise ValueError(f"a function name is 1 to 64 letters, digits, '_', '-', '.' or "
                             f"':', got {shown(name)}")
        return name

    @property
    def schema(self) -> dict[str, Any]:
        """The arguments' JSON schema: no ``parameters`` means no arguments (OpenAI's)."""
        if self.parameters is None:
            return {"type": "object", "properties": {}, "additionalProperties": False}
        return self.parameters


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class CalledFunction(Strict):
    name: str
    arguments: str  # JSON text, as the answer carried it


class ToolCallIn(Strict):
    """An assistant message's call, sent back in the conversation."""

    id: str
    type: Literal["function"] = "function"
    function: CalledFunction

    def as_template_input(self) -> dict[str, Any]:
        # Hugging Face templates take the arguments as an object (Qwen's and Llama's
        # ``tojson`` them) or as the string; an object is what both render right.
        try:
            arguments: Any = json_text.loads(self.function.arguments)
        except ValueError:
            arguments = self.function.arguments
        return {"id": self.id, "type": "function",
                "function": {"name": self.function.name, "arguments": arguments}}


ToolList = Annotated[list[Tool], Field(max_length=MAX_TOOLS)]


def template_tools(tools: list[Tool] | None) -> list[dict[str, Any]] | None:
    """``tools`` as Hugging Face chat templates take them (OpenAI's objects); None: none."""
    return [t.model_dump(exclude_none=True) for t in tools] if tools else None


def check_tool_choice(tools: list[Tool] | None, choice: ToolChoice | None,
                      given: bool) -> ToolChoice:
    """The effective ``tool_choice`` of a chat request; a ``Refusal`` (400) naming the field
    when it cannot be honoured whatever the server. ``given``: the body held the field."""
    if not tools:
        if given and choice is not None and choice != "none":
            raise Refusal("'tool_choice' needs 'tools': declare the functions it may call",
                          "tool_choice")
        return "none"
    names = [t.function.name for t in tools]
    duplicate = next((n for n in names if names.count(n) > 1), None)
    if duplicate is not None:
        raise Refusal(f"'tools' declares the function {duplicate!r} twice", "tools")
    if choice is None:
        return "auto"
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        raise Refusal(f"'tool_choice' names the function {shown(choice.function.name)}, "
                      f"which 'tools' does not declare (declared: {', '.join(names)})",
                      "tool_choice")
    return choice
