"""What a chat's render takes beyond its messages and tools, as vLLM takes it: the request
fields shared by ``/v1/chat/completions`` and ``/tokenize``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from kvledger.engine.server.validation import Refusal, Strict


class ChatTemplateOptions(Strict):
    """What a chat's render takes beyond its messages and tools, as vLLM takes them:
    ``continue_final_message`` leaves the last message open (no generation prompt then);
    ``chat_template`` (needs ``--trust-request-chat-template``) and
    ``chat_template_kwargs`` (e.g. Qwen3's ``enable_thinking``), rendered by
    ``model/chat_template.py``."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: Annotated[str, Field(min_length=1)] | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _open_final(self) -> ChatTemplateOptions:
        if self.continue_final_message:
            if self.add_generation_prompt and "add_generation_prompt" in self.model_fields_set:
                raise Refusal("'continue_final_message' and 'add_generation_prompt' cannot "
                              "both be true", "continue_final_message")
            self.add_generation_prompt = False
        return self

    def template_kwargs(self, defaults: Mapping[str, Any]) -> dict[str, Any]:
        """The variables the template gets beyond messages and tools: the server's
        ``--default-chat-template-kwargs`` under the request's ``chat_template_kwargs``."""
        return {**defaults, **(self.chat_template_kwargs or {})}


# vLLM 0.32's values (OpenAI's, and DeepSeek V4's "max").
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]


class ChatReasoningOptions(ChatTemplateOptions):
    """A chat's ``reasoning_effort`` (OpenAI's field; LiteLLM, LangChain's ``ChatOpenAI``
    and the Agents SDK send it), read as vLLM 0.32 reads it: a variable of the template
    (``reasoning_effort``, over a ``chat_template_kwargs`` entry of that name), and Qwen3's
    ``enable_thinking`` (false for ``"none"``, else true) unless the request's
    ``chat_template_kwargs`` names it. A template that reads neither renders as without it,
    as in vLLM: there is no reasoning parser or budget here for it to set."""

    reasoning_effort: ReasoningEffort | None = None

    def template_kwargs(self, defaults: Mapping[str, Any]) -> dict[str, Any]:
        kwargs = super().template_kwargs(defaults)
        if self.reasoning_effort is not None:
            kwargs["reasoning_effort"] = self.reasoning_effort
            if "enable_thinking" not in (self.chat_template_kwargs or {}):
                kwargs["enable_thinking"] = self.reasoning_effort != "none"
        return kwargs
