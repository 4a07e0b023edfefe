"""The fields a generation request shares, completions and chat alike (OpenAI's, then
vLLM's extensions), as one pydantic v2 model (``GenerationFields``): what each reads as,
its bounds, and what the engine takes from them (the cap, the usage wanted in a stream,
the output constraint). ``protocol`` declares the two requests on it.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar

from pydantic import Field, PrivateAttr, field_validator, model_validator

from kvledger.engine.sampling.params import MAX_LOGIT_BIAS_VALUE, MAX_LOGPROBS, MAX_PENALTY
from kvledger.engine.server.limits import (
    CLIENT_ID_PATTERN,
    MAX_ALLOWED_TOKEN_IDS,
    MAX_CACHE_SALT_CHARS,
    MAX_INT,
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_N,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_STOP_TOTAL_CHARS,
    shown,
)
from kvledger.engine.server.structured_outputs import (
    Constraint,
    ResponseFormat,
    StructuredOutputs,
    output_constraint,
)
from kvledger.engine.server.validation import (
    UNSUPPORTED_FIELDS,
    Refusal,
    Strict,
    known_fields,
    unset_nulls,
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


class GenerationFields(Strict):
    """The fields completions and chat share (OpenAI's, then vLLM's)."""

    kind: ClassVar[str]
    unsupported: ClassVar[dict[str, tuple[Any, ...]]] = UNSUPPORTED_FIELDS
    _spec: Constraint | None = PrivateAttr(default=None)
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
    # vLLM's: words never written (bounded as stop strings are)
    bad_words: list[Annotated[str, Field(min_length=1, max_length=MAX_STOP_STRING_CHARS)]] | None = Field(
        None, max_length=MAX_STOP_STRINGS)
    # vLLM's: the only tokens sampled (at most the vocabulary's worth: MAX_ALLOWED_TOKEN_IDS)
    allowed_token_ids: Annotated[list[TokenId], Field(min_length=1,
                                                      max_length=MAX_ALLOWED_TOKEN_IDS)] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    return_tokens_as_token_ids: bool = False  # logprobs name tokens "token_id:123"
    return_token_ids: bool = False  # vLLM's: the answer carries its prompt's and output's ids
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # vLLM's: lower is sooner, under --scheduling-policy priority (else only 0); None:
    # its tenant's default (server/tenants.py), else 0
    priority: Annotated[int, Field(ge=-MAX_INT - 1, le=MAX_INT)] | None = None
    # vLLM's: requests with different salts never share prefix-cache blocks
    cache_salt: Annotated[str, Field(min_length=1, max_length=MAX_CACHE_SALT_CHARS)] | None = None
    # vLLM's: the prompt tokenized with the tokenizer's special tokens (BOS); None: a
    # completion's true, a chat's false (its template writes its own)
    add_special_tokens: bool | None = None
    # vLLM's: a stream's tokens per chunk, raising the server's --stream-interval
    # (server/stream_interval.py); a whole answer ignores it
    stream_interval: PositiveInt | None = None
    # vLLM's: names the answer (cmpl-ID) unless an X-Request-Id header does
    request_id: Annotated[str, Field(pattern=CLIENT_ID_PATTERN)] | None = None

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
            # The length first: int() of a key past 4,300 digits raises its own error
            if not (key.isascii() and key.isdigit() and len(key) <= len(str(MAX_INT))
                    and int(key) <= MAX_INT):
                raise ValueError(f"keys must be token ids (\"123\"), got {shown(key)}")
        return bias

    @model_validator(mode="after")
    def _consistent(self) -> GenerationFields:
        if self.stream_options is not None and not self.stream:
            raise Refusal("'stream_options' is only allowed when 'stream' is true",
                           "stream_options")
        self._spec = output_constraint(self)  # checked (and its schema serialised) once
        if self._spec is not None and self.allowed_token_ids is not None:
            raise Refusal("'allowed_token_ids' and an output constraint would each choose the "
                          "tokens; use one", "allowed_token_ids")
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

    def force_usage(self) -> None:
        """``--enable-force-include-usage``: a stream's usage on every chunk and in a last
        chunk, whatever its ``stream_options`` ask (vLLM's ``should_include_usage``); an
        answer that is not streamed carries it anyway."""
        if self.stream:
            self.stream_options = StreamOptions(include_usage=True, continuous_usage_stats=True)

    @property
    def bias(self) -> dict[int, float] | None:
        return {int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None

    def grammar(self) -> Constraint | None:
        """The output constraint as ``(kind, value, layout)`` (``GrammarSpec``'s fields),
        or None."""
        return self._spec

