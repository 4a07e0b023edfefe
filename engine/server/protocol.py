"""OpenAI request bodies as pydantic v2 models, a completion's and a chat's, each on the
fields they share (``request_common.GenerationFields``): every field is implemented or
refused.

A field that would change the answer is either implemented (``n``, ``logprobs``,
penalties, ``logit_bias``, ``response_format``...) or refused with a 400 naming it;
a field nobody modelled is refused as unknown (``validation``: which fields are refused
or dropped by name, and the 400 naming the field at fault). Types are strict (``"10"`` is
not an integer, ``true`` is not 1), and sizes are bounded by ``limits`` (choices,
messages, stop strings, 64-bit integers), each refusal naming its limit. The output
constraint fields are read by ``structured_outputs``; a chat's messages are
``chat_message``'s.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar

from pydantic import Field, ValidationInfo, field_validator, model_validator

from kvledger.engine.server.chat_message import ChatMessage
from kvledger.engine.server.chat_options import ChatReasoningOptions
from kvledger.engine.server.limits import MAX_INT, few_messages
from kvledger.engine.server.request_common import GenerationFields, TopLogprobs
from kvledger.engine.server.structured_outputs import constraint_field
from kvledger.engine.server.tools.protocol import (
    NamedToolChoice,
    ToolChoice,
    ToolList,
    check_tool_choice,
    template_tools,
)
from kvledger.engine.server.validation import (
    CHAT_UNSUPPORTED_FIELDS,
    Refusal,
    prompt_batch,
    validate,
)


class CompletionRequest(GenerationFields):
    kind: ClassVar[str] = "completion"
    # OpenAI's and vLLM's default for completions: an unset max_tokens is 16 tokens (or
    # the room the prompt leaves, if less); null asks for the rest of the context.
    unset_cap: ClassVar[int | None] = 16
    # 0 only with echo: the prompt's text and logprobs, nothing generated (vLLM's).
    max_tokens: Annotated[int, Field(ge=0, le=MAX_INT)] | None = None
    # Always a batch: one prompt (a string or token ids) or several, each answered with
    # ``n`` choices indexed ``prompt * n + choice``, as OpenAI and vLLM do.
    prompt: Any
    echo: bool = False
    logprobs: TopLogprobs | None = None

    @model_validator(mode="after")
    def _echo_only(self) -> CompletionRequest:
        if self.max_tokens == 0 and not self.echo:
            raise Refusal("'max_tokens' must be at least 1 (0 only with 'echo': the prompt "
                          "scored, nothing generated)", "max_tokens")
        return self

    @property
    def echo_only(self) -> bool:
        """``echo`` with ``max_tokens`` 0: one token is computed (the prompt's logprobs come
        from its prefill), none is returned."""
        return self.echo and self.max_tokens == 0

    @property
    def cap(self) -> int | None:
        return 1 if self.echo_only else super().cap

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, prompt: Any, info: ValidationInfo) -> list[str | list[int]]:
        return prompt_batch(prompt, info.data.get("n", 1))  # n: a base field, validated before

    def logprobs_k(self) -> int | None:
        """Top alternatives reported per generated token; None: no logprobs."""
        return self.logprobs

    def prompt_logprobs_k(self) -> int | None:
        """``echo`` with ``logprobs``: the prompt's logprobs, from the prefill itself."""
        return self.logprobs if self.echo else None


class ChatRequest(GenerationFields, ChatReasoningOptions):
    kind: ClassVar[str] = "chat"
    unsupported: ClassVar[dict[str, tuple[Any, ...]]] = CHAT_UNSUPPORTED_FIELDS
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    logprobs: bool = False
    top_logprobs: TopLogprobs | None = None
    tools: ToolList | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    include_reasoning: bool = True  # vLLM's: false drops the reasoning (--reasoning-parser)

    _message_count = field_validator("messages", mode="before")(few_messages)

    @model_validator(mode="after")
    def _logprobs_given(self) -> ChatRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise Refusal("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        return self

    @model_validator(mode="after")
    def _tools(self) -> ChatRequest:
        self.tool_choice = check_tool_choice(self.tools, self.tool_choice,
                                             "tool_choice" in self.model_fields_set)
        if self.calls_required and self.allowed_token_ids is not None:
            raise Refusal(f"'tool_choice' {self.tool_choice_label} constrains the output "
                          "itself; drop 'allowed_token_ids'", "allowed_token_ids")
        if self.calls_required and self.grammar() is not None:
            raise Refusal(f"'tool_choice' {self.tool_choice_label} constrains the output "
                          f"itself; drop {constraint_field(self)}", "tool_choice")
        return self

    @property
    def calls_required(self) -> bool:
        """The output must be tool calls (``"required"`` or a named function)."""
        return self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice)

    @property
    def tool_choice_label(self) -> str:
        choice = self.tool_choice
        return repr(choice.function.name) if isinstance(choice, NamedToolChoice) else \
            json.dumps(choice)

    @property
    def template_messages(self) -> list[dict[str, Any]]:
        return [m.as_template_input() for m in self.messages]

    def answer_role(self, response_role: str) -> str:
        """The role of its answer, as vLLM's ``get_chat_request_role``: ``--response-role``
        with a generation prompt, else the last message's (a continued message's)."""
        return response_role if self.add_generation_prompt else self.messages[-1].role

    @property
    def template_tools(self) -> list[dict[str, Any]] | None:
        return template_tools(self.tools)

    def logprobs_k(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def prompt_logprobs_k(self) -> None:
        return None


GenerationRequest = CompletionRequest | ChatRequest


def parse_completion(body: Any) -> CompletionRequest:
    return validate(CompletionRequest, body)


def parse_chat(body: Any) -> ChatRequest:
    return validate(ChatRequest, body)
