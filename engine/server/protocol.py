"""OpenAI request bodies as pydantic v2 models: every field is implemented or refused.

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

from pydantic import Field, PrivateAttr, ValidationInfo, field_validator, model_validator

from kvledger.engine.sampling.params import MAX_LOGIT_BIAS_VALUE, MAX_LOGPROBS, MAX_PENALTY
from kvledger.engine.server.chat_message import ChatMessage
from kvledger.engine.server.chat_options import ChatTemplateOptions
from kvledger.engine.server.limits import (
    MAX_CACHE_SALT_CHARS,
    MAX_CLIENT_ID_CHARS,
    MAX_INT,
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_MESSAGES,
    MAX_N,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_STOP_TOTAL_CHARS,
    shown,
)
from kvledger.engine.server.structured_outputs import (
    ResponseFormat,
    StructuredOutputs,
    constraint_field,
    output_constraint,
)
from kvledger.engine.server.tools.protocol import (
    NamedToolChoice,
    ToolChoice,
    ToolList,
    check_tool_choice,
    template_tools,
)
from kvledger.engine.server.validation import (
    CHAT_UNSUPPORTED_FIELDS,
    UNSUPPORTED_FIELDS,
    Refusal,
    Strict,
    known_fields,
    prompt_batch,
    unset_nulls,
    validate,
)

PositiveInt = Annotated[int, Field(ge=1, le=MAX_INT)]
TokenId = Annotated[int, Field(ge=0, le=MAX_INT)]
Penalty = Annotated[float, Field(ge=-MAX_PENALTY, le=MAX_PENALTY)]
TopLogprobs = Annotated[int, Field(ge=0, le=MAX_LOGPROBS)]


class StreamOptions(Strict):
    """vLLM's: ``stream_options`` given asks for the usage (``include_usage`` defaults to
    true there, and a null is the default); ``continuous_usage_stats`` puts it on every
    chunk too, only with ``include_usage``."""

    include_usage: bool | None = True
    continuous_usage_stats: bool | None = False

    @model_validator(mode="before")
    @classmethod
    def _nulls(cls, data: Any) -> Any:
        return unset_nulls(data, cls.model_fields)


class _Request(Strict):
    """The fields completions and chat share (OpenAI's, then vLLM's)."""

    kind: ClassVar[str]
    unsupported: ClassVar[dict[str, tuple[Any, ...]]] = UNSUPPORTED_FIELDS
    _spec: tuple[str, str | None] | None = PrivateAttr(default=None)
    model: str | None = None  # None: the base model, as vLLM takes a request without one
    max_tokens: PositiveInt | None = None
    max_completion_tokens: PositiveInt | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    # Sampling: None (unset) takes the model's default (--generation-config), else vLLM's.
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    seed: Annotated[int, Field(ge=-(2**63), lt=2**64)] | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-MAX_LOGIT_BIAS_VALUE,
                                                 le=MAX_LOGIT_BIAS_VALUE)]] | None = None
    response_format: ResponseFormat | None = None
    user: str | None = None
    # vLLM's extensions
    top_k: Annotated[int, Field(ge=-1, le=MAX_INT)] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0, le=100.0)] | None = None
    min_tokens: Annotated[int, Field(ge=0, le=MAX_INT)] = 0
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    return_tokens_as_token_ids: bool = False  # logprobs name tokens "token_id:123"
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    # vLLM's: lower is sooner, under --scheduling-policy priority (else only 0); None:
    # its tenant's default (server/tenants.py), else 0
    priority: Annotated[int, Field(ge=-MAX_INT - 1, le=MAX_INT)] | None = None
    # vLLM's: requests with different salts never share prefix-cache blocks
    cache_salt: Annotated[str, Field(min_length=1, max_length=MAX_CACHE_SALT_CHARS)] | None = None
    # vLLM's: the prompt tokenized with the tokenizer's special tokens (BOS); None: a
    # completion's true, a chat's false (its template writes its own)
    add_special_tokens: bool | None = None
    # vLLM's: names the answer (cmpl-ID) unless an X-Request-Id header does
    request_id: Annotated[str, Field(min_length=1, max_length=MAX_CLIENT_ID_CHARS,
                                     pattern=r"^[!-~]+$")] | None = None

    @model_validator(mode="before")
    @classmethod
    def _known_fields(cls, data: Any) -> Any:
        return known_fields(data, cls.unsupported, cls.model_fields)

    @field_validator("stop")
    @classmethod
    def _stop(cls, stop: str | list[str] | None) -> list[str]:
        if stop is None:
            return []
        stop = [stop] if isinstance(stop, str) else stop
        if not all(stop):
            raise ValueError("stop strings must not be empty")
        # Each stop string is matched against the text after every token: bound their work.
        if len(stop) > MAX_STOP_STRINGS:
            raise ValueError(f"'stop' holds {len(stop)} strings; at most {MAX_STOP_STRINGS} "
                             f"are allowed")
        longest = max((len(s) for s in stop), default=0)
        if longest > MAX_STOP_STRING_CHARS:
            raise ValueError(f"a 'stop' string is {longest} characters long; at most "
                             f"{MAX_STOP_STRING_CHARS} are allowed")
        total = sum(len(s) for s in stop)
        if total > MAX_STOP_TOTAL_CHARS:
            raise ValueError(f"the 'stop' strings hold {total} characters together; at most "
                             f"{MAX_STOP_TOTAL_CHARS} are allowed")
        return stop

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_token_ids(cls, ids: list[int] | None) -> list[int] | None:
        if ids is not None and len(ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"'stop_token_ids' holds {len(ids)} ids; at most "
                             f"{MAX_STOP_TOKEN_IDS} are allowed")
        return ids

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        if bias is None:
            return None
        if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise ValueError(f"'logit_bias' holds {len(bias)} entries; at most "
                             f"{MAX_LOGIT_BIAS_ENTRIES} are allowed")
        for key in bias:
            if not (key.isascii() and key.isdigit() and int(key) <= MAX_INT):
                raise ValueError(f"keys must be token ids (\"123\"), got {shown(key)}")
        return bias

    @model_validator(mode="after")
    def _consistent(self) -> _Request:
        if self.stream_options is not None and not self.stream:
            raise Refusal("'stream_options' is only allowed when 'stream' is true",
                           "stream_options")
        self._spec = output_constraint(self)  # checked (and its schema serialised) once
        return self

    # -- what the engine needs ------------------------------------------------------
    @property
    def cap(self) -> int | None:
        """The requested output cap; ``max_completion_tokens`` is the current name."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    unset_cap: ClassVar[int | None] = None  # a request's cap when it names none (None: the door's)

    @property
    def default_cap(self) -> int | None:
        """The cap of a request that names none, neither set nor sent as null:
        ``unset_cap`` (completions' 16), else None (the rest of the context, as the door
        rules)."""
        named = {"max_tokens", "max_completion_tokens"} & self.model_fields_set
        return None if named else self.unset_cap

    @property
    def echo_only(self) -> bool:
        """The prompt echoed, nothing generated returned (completions' ``echo``)."""
        return False

    @property
    def special_tokens_added(self) -> bool:
        """Whether the prompt's text is tokenized with the tokenizer's special tokens."""
        if self.add_special_tokens is not None:
            return self.add_special_tokens
        return self.kind != "chat"

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and bool(self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and bool(self.stream_options.continuous_usage_stats)

    @property
    def bias(self) -> dict[int, float] | None:
        return {int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None

    def grammar(self) -> tuple[str, str | None] | None:
        """The output constraint as ``(kind, value)`` (``GrammarSpec``'s fields), or None."""
        return self._spec

class CompletionRequest(_Request):
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


class ChatRequest(_Request, ChatTemplateOptions):
    kind: ClassVar[str] = "chat"
    unsupported: ClassVar[dict[str, tuple[Any, ...]]] = CHAT_UNSUPPORTED_FIELDS
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    logprobs: bool = False
    top_logprobs: TopLogprobs | None = None
    tools: ToolList | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True

    @field_validator("messages", mode="before")
    @classmethod
    def _message_count(cls, messages: Any) -> Any:
        if isinstance(messages, list) and len(messages) > MAX_MESSAGES:
            raise ValueError(f"holds {len(messages)} messages; at most {MAX_MESSAGES} are "
                             f"allowed per request")
        return messages

    @model_validator(mode="after")
    def _logprobs_given(self) -> ChatRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise Refusal("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        return self

    @model_validator(mode="after")
    def _tools(self) -> ChatRequest:
        self.tool_choice = check_tool_choice(self.tools, self.tool_choice,
                                             "tool_choice" in self.model_fields_set)
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
