"""A chat message as a client sends it (OpenAI's roles, text content or text parts, an
assistant's tool calls, a tool's answer), and what the chat template renders of it: the
messages of ``/v1/chat/completions`` and of ``/tokenize``."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import field_validator

from kvledger.engine.server.tools.protocol import ToolCallIn
from kvledger.engine.server.validation import Strict


class ChatMessage(Strict):
    """A message, as a client sends it or sends back an answer's message whole (OpenAI's
    SDK's ``message.model_dump()``): the answer's own fields, ``refusal``, ``annotations``,
    ``audio`` and ``function_call`` null, are taken and change nothing; an assistant's
    ``reasoning`` (or ``reasoning_content``) reaches the template under both names, as vLLM
    passes it; a tool's text parts reach it as one string."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Any = None  # a string, or text parts {"type": "text", "text": ...} (the rest dropped)
    name: str | None = None
    refusal: str | None = None  # an answer's message, sent back
    annotations: list[Any] | None = None
    audio: None = None
    function_call: None = None
    reasoning: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # an assistant's calls, sent back
    tool_call_id: str | None = None             # a tool message: the call it answers

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, content: Any) -> str | list[dict[str, str]]:
        if isinstance(content, str):
            return content
        if content is None:
            return ""
        if isinstance(content, list):
            parts = []
            for part in content:
                if not (isinstance(part, dict) and part.get("type") == "text"):
                    raise ValueError("parts must be {\"type\": \"text\", \"text\": ...}; other "
                                     "modalities are not supported")
                if not isinstance(part.get("text"), str):
                    raise ValueError("a text part's 'text' must be a string")
                parts.append({"type": "text", "text": part["text"]})
            return parts
        raise ValueError("must be a string or a list of text parts")

    @field_validator("tool_calls")
    @classmethod
    def _tool_calls(cls, calls: list[ToolCallIn] | None, info) -> list[ToolCallIn] | None:
        if calls is not None and info.data.get("role") != "assistant":
            raise ValueError("only assistant messages carry tool calls")
        return calls

    @field_validator("tool_call_id")
    @classmethod
    def _tool_call_id(cls, call_id: str | None, info) -> str | None:
        if call_id is not None and info.data.get("role") != "tool":
            raise ValueError("only tool messages answer a tool call")
        return call_id

    def as_template_input(self) -> dict[str, Any]:
        """The message as a chat template reads it (its content put in the template's
        format by ``chat_template.render``)."""
        content = self.content
        if self.role == "tool" and isinstance(content, list):  # a string always, as vLLM's
            content = "\n".join(part["text"] for part in content)
        message: dict[str, Any] = {"role": self.role, "content": content}
        if self.name is not None:
            message["name"] = self.name
        reasoning = self.reasoning if self.reasoning is not None else self.reasoning_content
        if self.role == "assistant" and reasoning is not None:
            message["reasoning"] = message["reasoning_content"] = reasoning
        if self.tool_calls:
            message["tool_calls"] = [c.as_template_input() for c in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message
