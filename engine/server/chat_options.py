"""What a chat's render takes beyond its messages and tools, as vLLM takes it: the request
fields shared by ``/v1/chat/completions`` and ``/tokenize``."""

from __future__ import annotations

from typing import Annotated, Any

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
