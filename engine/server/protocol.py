"""OpenAI request bodies as pydantic v2 models: every field is implemented or refused.

A field that would change the answer is either implemented (``n``, ``logprobs``,
penalties, ``logit_bias``, ``response_format``...) or refused with a 400 naming it;
a field nobody modelled is refused as unknown. Only the fields in ``IGNORED_FIELDS``,
which change nothing a server like this one returns, are accepted and dropped. Types are
strict (``"10"`` is not an integer, ``true`` is not 1), and sizes are bounded by
``limits`` (messages, stop strings, 64-bit integers), each refusal naming its limit.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)

from kvledger.engine.server.api_errors import ApiError, bad_request
from kvledger.engine.server.limits import (
    MAX_INT,
    MAX_MESSAGES,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_STOP_TOTAL_CHARS,
    shown,
)

ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_N = 128                 # OpenAI's limit on choices per request
MAX_LOGPROBS = 20           # vLLM's default --max-logprobs
MAX_LOGIT_BIAS = 1024       # entries in one request's logit_bias
MAX_CACHE_SALT_CHARS = 1024  # vLLM suggests 43 (256 random bits, base64)

# Accepted and dropped: they change nothing this server returns (OpenAI's bookkeeping
# and routing hints). Each value is the type it must have.
IGNORED_FIELDS: dict[str, type | tuple[type, ...]] = {
    "metadata": dict, "store": bool, "service_tier": str, "parallel_tool_calls": bool,
    "prompt_cache_key": str, "safety_identifier": str, "modalities": list,
}
# Known fields this server does not implement: a 400 "not supported" unless the value
# is one of the neutral ones listed (which means "off").
UNSUPPORTED_FIELDS: dict[str, tuple[Any, ...]] = {
    "best_of": (None, 1), "suffix": (None, ""), "tools": (None, []),
    "tool_choice": (None, "none"), "functions": (None, []), "function_call": (None, "none"),
    "audio": (None,), "prediction": (None,), "reasoning_effort": (None,),
    "web_search_options": (None,), "min_p": (None, 0, 0.0), "use_beam_search": (None, False),
    "length_penalty": (None, 1, 1.0), "truncate_prompt_tokens": (None,),
    "skip_special_tokens": (None, True), "spaces_between_special_tokens": (None, True),
    "continue_final_message": (None, False), "chat_template": (None,),
    "chat_template_kwargs": (None, {}), "documents": (None, []), "priority": (None, 0),
    "prompt_logprobs": (None,), "guided_grammar": (None,), "guided_decoding_backend": (None,),
}
# vLLM's chat ``echo`` repeats the last message; not implemented (completions' is).
CHAT_UNSUPPORTED_FIELDS = {**UNSUPPORTED_FIELDS, "echo": (None, False)}

PositiveInt = Annotated[int, Field(ge=1, le=MAX_INT)]
TokenId = Annotated[int, Field(ge=0, le=MAX_INT)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
TopLogprobs = Annotated[int, Field(ge=0, le=MAX_LOGPROBS)]


class Strict(BaseModel):
    """Unknown fields refused, no coercion (``"10"`` is not 10), no NaN or infinity."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False,
                              hide_input_in_errors=True)


class StreamOptions(Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaFormat(Strict):
    name: str = "response"
    schema_: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(Strict):
    """vLLM's ``structured_outputs``: one of these constraints."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    json_object: bool | None = None


class _Request(Strict):
    """The fields completions and chat share (OpenAI's, then vLLM's)."""

    kind: ClassVar[str]
    unsupported: ClassVar[dict[str, tuple[Any, ...]]] = UNSUPPORTED_FIELDS
    _spec: tuple[str, str | None] | None = PrivateAttr(default=None)
    model: str
    max_tokens: PositiveInt | None = None
    max_completion_tokens: PositiveInt | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    seed: Annotated[int, Field(ge=-(2**63), lt=2**64)] | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    response_format: ResponseFormat | None = None
    user: str | None = None
    # vLLM's extensions
    top_k: Annotated[int, Field(ge=-1, le=MAX_INT)] = -1
    repetition_penalty: Annotated[float, Field(gt=0.0, le=100.0)] = 1.0
    min_tokens: Annotated[int, Field(ge=0, le=MAX_INT)] = 0
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    return_tokens_as_token_ids: bool = False  # logprobs name tokens "token_id:123"
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    # vLLM's: requests with different salts never share prefix-cache blocks
    cache_salt: Annotated[str, Field(min_length=1, max_length=MAX_CACHE_SALT_CHARS)] | None = None

    @model_validator(mode="before")
    @classmethod
    def _known_fields(cls, data: Any) -> Any:
        """Refuse the known-but-unsupported fields by name; drop the ignored ones."""
        if not isinstance(data, dict):
            raise _Refusal("the request body must be a JSON object")
        unsupported = cls.unsupported
        if not (unsupported.keys() & data.keys() or IGNORED_FIELDS.keys() & data.keys()):
            return data  # the common case: nothing to drop
        data = dict(data)
        for name in unsupported.keys() & data.keys():
            value = data.pop(name)
            if not any(value == v and type(value) is type(v) for v in unsupported[name]):
                raise _Refusal(f"'{name}' is not supported by this server", name)
        for name in IGNORED_FIELDS.keys() & data.keys():
            value = data.pop(name)
            if value is not None and not isinstance(value, IGNORED_FIELDS[name]):
                raise _Refusal(f"'{name}' must be a {_type_name(IGNORED_FIELDS[name])}", name)
        return data

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
        if len(bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"'logit_bias' holds {len(bias)} entries; at most "
                             f"{MAX_LOGIT_BIAS} are allowed")
        for key in bias:
            if not (key.isascii() and key.isdigit() and int(key) <= MAX_INT):
                raise ValueError(f"keys must be token ids (\"123\"), got {shown(key)}")
        return bias

    @model_validator(mode="after")
    def _consistent(self) -> _Request:
        if self.stream_options is not None and not self.stream:
            raise _Refusal("'stream_options' is only allowed when 'stream' is true",
                           "stream_options")
        constraints = [name for name in ("response_format", "structured_outputs", "guided_json",
                                         "guided_regex", "guided_choice")
                       if getattr(self, name) is not None]
        if self.response_format is not None and self.response_format.type == "text":
            constraints.remove("response_format")
        if len(constraints) > 1:
            raise _Refusal(f"only one output constraint may be given, got "
                           f"{', '.join(constraints)}", constraints[1])
        if self.response_format is not None and self.response_format.type == "json_schema" \
                and self.response_format.json_schema is None:
            raise _Refusal("'response_format' of type json_schema needs 'json_schema': "
                           "{\"name\": ..., \"schema\": {...}}", "response_format")
        self._spec = self._constraint()  # checked (and its schema serialised) once
        return self

    # -- what the engine needs ------------------------------------------------------
    @property
    def cap(self) -> int | None:
        """The requested output cap; ``max_completion_tokens`` is the current name."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage_stats

    @property
    def bias(self) -> dict[int, float] | None:
        return {int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None

    def grammar(self) -> tuple[str, str | None] | None:
        """The output constraint as ``(kind, value)`` (``GrammarSpec``'s fields), or None."""
        return self._spec

    def _constraint(self) -> tuple[str, str | None] | None:
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            return "json_object", None
        if fmt is not None and fmt.type == "json_schema":
            return "json_schema", _schema_text(fmt.json_schema.schema_, "response_format")
        so = self.structured_outputs
        if so is None:
            return _spec(self.guided_json, self.guided_regex, self.guided_choice,
                         ("guided_json", "guided_regex", "guided_choice"))
        given = [k for k in ("json_", "regex", "choice", "json_object") if getattr(so, k)]
        if len(given) != 1:
            raise _Refusal("'structured_outputs' must hold exactly one of json, regex, choice "
                           "or json_object", "structured_outputs")
        return _spec(so.json_, so.regex, so.choice, ("structured_outputs",) * 3) \
            or ("json_object", None)


class CompletionRequest(_Request):
    kind: ClassVar[str] = "completion"
    prompt: Any
    echo: bool = False
    logprobs: TopLogprobs | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, prompt: Any) -> str | list[int]:
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("must not be empty")
            return prompt
        if isinstance(prompt, list) and prompt and all(_is_token_id(t) for t in prompt):
            return prompt
        if isinstance(prompt, list) and len(prompt) > 1 \
                and all(isinstance(p, str | list) for p in prompt):
            raise ValueError("batched prompts are not supported: send one prompt per request")
        raise ValueError("must be a non-empty string or a list of token ids")

    def logprobs_k(self) -> int | None:
        """Top alternatives reported per generated token; None: no logprobs."""
        return self.logprobs

    def prompt_logprobs_k(self) -> int | None:
        """``echo`` with ``logprobs``: the prompt's logprobs, from the prefill itself."""
        return self.logprobs if self.echo else None


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Any = None
    name: str | None = None
    refusal: None = None  # an assistant message may echo back OpenAI's null refusal

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

    def as_template_input(self) -> dict[str, str]:
        message = {"role": self.role, "content": self.content}
        if self.name is not None:
            message["name"] = self.name
        return message


class ChatRequest(_Request):
    kind: ClassVar[str] = "chat"
    unsupported: ClassVar[dict[str, tuple[Any, ...]]] = CHAT_UNSUPPORTED_FIELDS
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    logprobs: bool = False
    top_logprobs: TopLogprobs | None = None
    add_generation_prompt: bool = True

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
            raise _Refusal("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        return self

    @property
    def template_messages(self) -> list[dict[str, str]]:
        return [m.as_template_input() for m in self.messages]

    def logprobs_k(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def prompt_logprobs_k(self) -> None:
        return None


GenerationRequest = CompletionRequest | ChatRequest


def parse_completion(body: Any) -> CompletionRequest:
    return validate(CompletionRequest, body)


def parse_chat(body: Any) -> ChatRequest:
    return validate(ChatRequest, body)


class _Refusal(ValueError):
    """A 400 raised inside validation, with the field it names."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param = message, param


def validate(model: type[BaseModel], body: Any) -> Any:
    """``model`` validated from ``body``, or the 400 naming the first field at fault."""
    try:
        return model.model_validate(body)
    except _Refusal as exc:
        raise bad_request(exc.message, exc.param) from None
    except ValidationError as exc:
        raise _first_error(exc) from None


_TYPE_MESSAGES = {"int_type": "must be an integer", "float_type": "must be a number",
                  "bool_type": "must be true or false", "string_type": "must be a string",
                  "list_type": "must be a list", "dict_type": "must be a JSON object",
                  "model_type": "must be a JSON object", "finite_number": "must be finite"}


def _first_error(exc: ValidationError) -> ApiError:
    error = exc.errors(include_url=False)[0]
    cause = (error.get("ctx") or {}).get("error")
    if isinstance(cause, _Refusal):
        return bad_request(cause.message, cause.param)
    param = _param(error["loc"])
    if not param:
        return bad_request("the request body must be a JSON object" if error["type"] ==
                           "model_type" else str(cause or error["msg"]))
    if error["type"] == "extra_forbidden":
        return bad_request(f"unknown field '{param}': this server does not implement it",
                           param)
    if error["type"] == "missing":
        return bad_request(f"missing required field '{param}'", param)
    if error["type"] in _TYPE_MESSAGES:
        return bad_request(f"'{param}' {_TYPE_MESSAGES[error['type']]}, got "
                           f"{shown(error['input'])}", param)
    message = str(cause) if isinstance(cause, ValueError) else error["msg"]
    return bad_request(f"'{param}': {message}", param)


def _param(loc: tuple[int | str, ...]) -> str:
    """``("messages", 0, "role")`` -> ``messages[0].role``; pydantic's union branch
    names (``str``, ``list[str]``) are dropped."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif "[" in part or part in ("str", "int", "float", "bool", "dict", "list"):
            continue
        else:
            out += f".{part}" if out else part
    return out


def _schema_text(schema: dict[str, Any] | str, field: str) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError:
            raise _Refusal(f"'{field}' must hold a JSON schema object", field) from None
    if not isinstance(schema, dict):
        raise _Refusal(f"'{field}' must hold a JSON schema object", field)
    return json.dumps(schema, sort_keys=True, separators=(",", ":"))


def _spec(schema: dict[str, Any] | str | None, regex: str | None, choice: list[str] | None,
          fields: tuple[str, str, str]) -> tuple[str, str | None] | None:
    """The one constraint given among a JSON schema, a regex and a choice list, or None."""
    if schema is not None:
        return "json_schema", _schema_text(schema, fields[0])
    if regex is not None:
        return "regex", regex
    if choice is not None:
        return _choice(choice, fields[2])
    return None


def _choice(options: list[str], field: str) -> tuple[str, str]:
    if not options or not all(options):
        raise _Refusal(f"'{field}' must be a non-empty list of non-empty strings", field)
    return "choice", json.dumps(options)


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_INT


def _type_name(kind: type | tuple[type, ...]) -> str:
    return {dict: "JSON object", bool: "boolean", str: "string", list: "list"}.get(kind, "value")
