"""A chat message as a client sends it (OpenAI's roles, text content or text parts, an
assistant's tool calls, a tool's answer), and what the chat template renders of it: the
messages of ``/v1/chat/completions`` and of ``/tokenize``."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import field_validator

from kvledger.engine.server.tools.protocol import ToolCallIn
from kvledger.engine.server.validation import Strict


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Any = None
    name: str | None = None
    refusal: None = None  # an assistant message may echo back OpenAI's null refusal
    tool_calls: list[ToolCallIn] | None = None  # an assistant's calls, sent back
    tool_call_id: str | None = None             # a tool message: the call it answers

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, content: Any) -> str:
        if isinstance(content, str):
            return content
        if content is None:
            return ""
        if isinstance(content, list):
            texts = []
            for part in content:
                if not (isinstance(part, dict) and part.get("type") == "text"
                        and isinstance(part.get("text"), str) and len(part) == 2):
                    raise ValueError("parts must be {\"type\": \"text\", \"text\": ...}; other "
                                     "modalities are not supported")
                texts.append(part["text"])
            return "".join(texts)
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
        message: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [c.as_template_input() for c in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message
