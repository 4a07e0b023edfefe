"""A Responses request's ``input`` items as the chat messages they stand for, as vLLM 0.32
reads them (``responses/utils.py``, ``construct_chat_messages_with_tool_call``): a
``message`` item is a message of its role, a ``function_call`` an assistant's tool call
(joined to the assistant message before it), a ``function_call_output`` a ``tool``
message, a ``reasoning`` item an assistant's ``reasoning``. An answer's items sent back
whole, as the OpenAI SDK and the Agents SDK send them (``id``, ``status``,
``annotations``, ``logprobs``...), are taken; those fields change nothing. Built-in tools'
items and other modalities are a 400 naming the item.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator

from kvledger.engine.server.limits import few_messages, shown
from kvledger.engine.server.validation import Refusal, Strict, refusal_within

Status = Literal["in_progress", "completed", "incomplete"] | None


class TextPart(Strict):
    """Text content: a user's ``input_text``, an answer's ``output_text`` (its
    ``annotations`` and ``logprobs`` sent back), or its ``refusal``."""

    type: str
    text: str | None = None
    refusal: str | None = None  # a refusal part's text
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None
    prompt_cache_breakpoint: dict[str, Any] | None = None  # OpenAI's caching hint

    @field_validator("type")
    @classmethod
    def _text_only(cls, kind: str) -> str:
        if kind not in ("input_text", "output_text", "refusal"):
            raise ValueError(f"{shown(kind)} parts are not supported: only text is "
                             f"(input_text, output_text, refusal)")
        return kind

    @property
    def content(self) -> str:
        """The part's text; a ``Refusal`` naming the field it lacks (``text``)."""
        field = "refusal" if self.type == "refusal" else "text"
        value = self.refusal if self.type == "refusal" else self.text
        if not isinstance(value, str):
            raise Refusal(f"the {self.type} part has no '{field}'", field)
        return value


class MessageItem(Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: list[TextPart] | str  # a list's errors first: they name the part
    id: str | None = None
    status: Status = None
    phase: Literal["commentary", "final_answer"] | None = None  # an answer's, sent back


class FunctionCallItem(Strict):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: Status = None
    namespace: None = None  # OpenAI's tool namespaces are not served
    caller: dict[str, Any] | None = None


class FunctionCallOutputItem(Strict):
    type: Literal["function_call_output"]
    call_id: str
    output: list[TextPart] | str
    id: str | None = None
    status: Status = None
    caller: dict[str, Any] | None = None


class ReasoningText(Strict):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(Strict):
    type: Literal["reasoning"]
    summary: list[ReasoningText] = Field(default_factory=list)
    content: list[ReasoningText] | None = None
    encrypted_content: None = None  # never issued here, so never taken back
    id: str | None = None
    status: Status = None


_ITEMS: dict[str, type[Strict]] = {
    "message": MessageItem, "function_call": FunctionCallItem,
    "function_call_output": FunctionCallOutputItem, "reasoning": ReasoningItem,
}
InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem


def input_items(value: Any) -> Any:
    """``input`` validated item by item, each by its ``type`` (a message's may be left
    out), so a refusal names the item and its field (``input[2].call_id``)."""
    if not isinstance(value, list):
        return value  # a string, or the model's own type error
    few_messages(value)
    items = []
    for index, item in enumerate(value):
        kind = item.get("type", "message") if isinstance(item, dict) else None
        model = _ITEMS.get(kind) if isinstance(kind, str) else MessageItem
        if model is None:
            raise Refusal(f"input items of type {kind!r} are not supported by this server "
                          f"(it serves messages, function calls and their outputs, and "
                          f"reasoning; no built-in tools)", f"input[{index}].type")
        try:
            items.append(model.model_validate(item))
        except ValidationError as exc:
            raise refusal_within(exc, ("input", index)) from None
        except Refusal as exc:
            raise Refusal(exc.message, f"input[{index}]") from None
    return items


def chat_messages(input_: str | list[InputItem], instructions: str | None) -> list[dict]:
    """The chat messages ``input`` stands for, ``instructions`` first as a system message."""
    messages: list[dict[str, Any]] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    if isinstance(input_, str):
        return [*messages, {"role": "user", "content": input_}]
    for index, item in enumerate(input_):
        try:
            _add(messages, item)
        except Refusal as exc:  # the field within the item, when it names one
            where = f"input[{index}]" + (f".{exc.param}" if exc.param else "")
            raise Refusal(exc.message, where) from None
    return messages


def continues_final_message(input_: str | list[InputItem]) -> bool:
    """vLLM's partial answer: a last assistant message sent back ``in_progress`` or
    ``incomplete`` is continued, not answered (``should_continue_final_message``)."""
    if isinstance(input_, str) or not input_ \
            or not isinstance(input_[-1], MessageItem | ReasoningItem):
        return False
    last = input_[-1]
    return last.status in ("in_progress", "incomplete") and (
        isinstance(last, ReasoningItem) or last.role == "assistant")


def _add(messages: list[dict[str, Any]], item: InputItem) -> None:
    """``item`` as a new chat message, or joined to the assistant message before it (a
    call, or reasoning or text it does not hold yet), as vLLM joins them."""
    last = messages[-1] if messages and messages[-1]["role"] == "assistant" else None
    if isinstance(item, FunctionCallItem):
        call = {"id": item.call_id, "type": "function",
                "function": {"name": item.name, "arguments": item.arguments}}
        if last is not None:
            last.setdefault("tool_calls", []).append(call)
        else:
            messages.append({"role": "assistant", "tool_calls": [call]})
    elif isinstance(item, FunctionCallOutputItem):
        messages.append({"role": "tool", "tool_call_id": item.call_id,
                         "content": _text(item.output, "output", "\n")})
    elif isinstance(item, ReasoningItem):
        parts = item.content or item.summary
        text = parts[0].text if parts else ""
        if last is not None and "reasoning" not in last:
            last["reasoning"] = text
        else:
            messages.append({"role": "assistant", "reasoning": text})
    elif item.role == "assistant" and last is not None and "content" not in last:
        last["content"] = _text(item.content, "content")
    else:
        messages.append({"role": item.role, "content": _text(item.content, "content")})


def _text(content: str | list[TextPart], field: str, sep: str | None = None) -> Any:
    """A string stays one; parts become chat's text parts (joined with ``sep`` if given:
    a tool's output is one string). A part without its text is a ``Refusal`` naming it
    within the item (``content[1].text``); ``field`` is the item's field holding them."""
    if isinstance(content, str):
        return content
    texts = []
    for index, part in enumerate(content):
        try:
            texts.append(part.content)
        except Refusal as exc:
            raise Refusal(exc.message, f"{field}[{index}].{exc.param}") from None
    if sep is not None:
        return sep.join(texts)
    return [{"type": "text", "text": text} for text in texts]
