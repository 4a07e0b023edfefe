"""A ``POST /v1/responses`` body (OpenAI's Responses API, as vLLM 0.32 serves it for a
model without Harmony) and the chat request it is served as.

The Responses fields are modelled here (``ResponsesRequest``); the sampling fields both
APIs share (``temperature``, ``top_p``, ``seed``, ``stop``, vLLM's ``top_k``...) go over
to the chat request unread and are judged there, so each rule has one owner. The chat
request (``TranslatedChat``) then takes the chat route's path whole: admission, keys,
tenants, limits, metrics. What this server cannot do is refused by name: built-in tools
(web search, file search, code interpreter, MCP...), ``background`` and
``previous_response_id`` (responses are not stored, as in vLLM without
``VLLM_ENABLE_RESPONSES_API_STORE``), ``conversation`` and ``prompt`` templates.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, PrivateAttr, field_validator, model_validator

from kvledger.engine.server.api_errors import ApiError, bad_request
from kvledger.engine.server.limits import MAX_INT, shown
from kvledger.engine.server.protocol import ChatRequest
from kvledger.engine.server.responses_fields import (
    FunctionTool,
    Metadata,
    NamedFunction,
    Reasoning,
    StreamOptions,
    TextConfig,
)
from kvledger.engine.server.responses_items import (
    InputItem,
    chat_messages,
    continues_final_message,
    input_items,
)
from kvledger.engine.server.validation import Refusal, Strict, known_fields, validate

# Fields both APIs share: copied into the chat request as sent, and judged there.
SHARED_FIELDS = ("model", "stream", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
                 "stop_token_ids", "presence_penalty", "frequency_penalty",
                 "repetition_penalty", "logit_bias", "ignore_eos", "skip_special_tokens",
                 "include_stop_str_in_output", "priority", "cache_salt", "request_id", "user",
                 "chat_template_kwargs", "structured_outputs", "parallel_tool_calls")
# vLLM's Responses extensions this server does not implement, and their neutral values.
UNSUPPORTED = {
    "watermarking": (None, False), "media_io_kwargs": (None,), "mm_processor_kwargs": (None,),
    "mm_payload": (None, "tensors"), "return_mm_kwargs": (None,),
    "enable_response_messages": (None, False), "previous_input_messages": (None, []),
    "vllm_xargs": (None,), "kv_transfer_params": (None,), "ec_transfer_params": (None,),
    "context_management": (None,), "conversation": (None,), "session_id": (None,),
}
# ``include`` values: vLLM's; only the logprobs change what this server returns.
LOGPROBS = "message.output_text.logprobs"
Includable = Literal["code_interpreter_call.outputs", "computer_call_output.output.image_url",
                     "file_search_call.results", "message.input_image.image_url", LOGPROBS,
                     "reasoning.encrypted_content", "web_search_call.action.sources",
                     "web_search_call.results"]
# A chat field's Responses name, for a refusal of the chat request (or of the door).
_RESPONSES_NAMES = {"messages": "input",
                    "max_completion_tokens": "max_output_tokens",
                    "max_tokens": "max_output_tokens", "response_format": "text.format",
                    "reasoning_effort": "reasoning.effort", "logprobs": "include"}
_CAP_NAMES = re.compile(r"\bmax_(?:completion_)?tokens\b")


class ResponsesRequest(Strict):
    """The Responses API's own fields (the shared ones are the chat request's)."""

    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: Annotated[int, Field(ge=1, le=MAX_INT)] | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    reasoning: Reasoning | None = None
    include: list[Includable] | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    include_reasoning: bool = True  # vLLM's: false drops the reasoning (--reasoning-parser)
    truncation: Literal["auto", "disabled"] = "disabled"
    metadata: Metadata | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] = "auto"
    store: bool = True
    background: bool = False
    previous_response_id: str | None = None
    prompt: None = None
    stream_options: StreamOptions | None = None
    prompt_cache_retention: str | None = None
    max_tool_calls: Annotated[int, Field(ge=1, le=MAX_INT)] | None = None  # built-in tools'

    unsupported: ClassVar[dict[str, tuple[Any, ...]]] = UNSUPPORTED

    @model_validator(mode="before")
    @classmethod
    def _known_fields(cls, data: Any) -> Any:
        data = known_fields(data, cls.unsupported, cls.model_fields)
        if data.get("prompt") is not None:
            raise Refusal("prompt templates are not supported (as in vLLM): send 'input'",
                          "prompt")
        return data

    _input = field_validator("input", mode="before")(input_items)

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools(cls, tools: Any) -> Any:
        for index, tool in enumerate(tools if isinstance(tools, list) else []):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if isinstance(kind, str) and kind != "function":
                raise Refusal(f"built-in tools are not served: 'tools[{index}]' is of type "
                              f"{shown(kind)}; this server calls only the client's own "
                              f"functions (type 'function')", f"tools[{index}].type")
        return tools

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _function_choice(cls, choice: Any) -> Any:
        if isinstance(choice, dict) and choice.get("type") not in ("function", None):
            raise Refusal(f"a 'tool_choice' of type {shown(choice.get('type'))} is not "
                          f"supported: built-in tools are not served", "tool_choice")
        return choice

    @model_validator(mode="after")
    def _unstored(self) -> ResponsesRequest:
        if self.background:
            raise Refusal("'background' needs responses kept to be fetched later, and this "
                          "server keeps none (as vLLM without "
                          "VLLM_ENABLE_RESPONSES_API_STORE)", "background")
        return self

    @property
    def logprobs(self) -> bool:
        return LOGPROBS in (self.include or ())

    @property
    def effective_tool_choice(self) -> str | NamedFunction:
        """vLLM's: no tools mean ``"none"``; tools without a choice ``"auto"``."""
        if not self.tools:
            return "none" if self.tool_choice in (None, "auto", "none") else self.tool_choice
        return self.tool_choice or "auto"

    def chat_body(self, shared: dict[str, Any]) -> dict[str, Any]:
        """The chat completions body this request is served as."""
        body: dict[str, Any] = {**shared, "messages": chat_messages(self.input, self.instructions)}
        if self.max_output_tokens is not None:
            body["max_completion_tokens"] = self.max_output_tokens
        if self.tools:
            body["tools"] = [tool.as_chat() for tool in self.tools]
        choice = self.effective_tool_choice
        if choice != "none" or self.tools:
            body["tool_choice"] = ({"type": "function", "function": {"name": choice.name}}
                                   if isinstance(choice, NamedFunction) else choice)
        if self.text is not None and self.text.format is not None:
            body["response_format"] = self.text.format.as_response_format()
        if self.reasoning is not None and self.reasoning.effort is not None:
            body["reasoning_effort"] = self.reasoning.effort
        if not self.include_reasoning:
            body["include_reasoning"] = False
        if self.logprobs:
            body["logprobs"] = True
            body["top_logprobs"] = self.top_logprobs or 0
        if continues_final_message(self.input):
            body["continue_final_message"] = True
        return body


class TranslatedChat(ChatRequest):
    """The chat request a Responses body is served as; ``responses`` is that body, which
    the answer echoes and is shaped by."""

    _responses: ResponsesRequest | None = PrivateAttr(default=None)

    @property
    def responses(self) -> ResponsesRequest:
        assert self._responses is not None
        return self._responses


class NamedRefusal(ApiError):
    """A refusal that already names this API's fields (``parse_responses``'): the route
    passes it on as it is, where it renames the door's (``responses_error``). Renamed
    twice, a body's own unknown ``max_tokens`` read "unknown field 'max_output_tokens'"."""

    @classmethod
    def of(cls, exc: ApiError) -> NamedRefusal:
        return cls(exc.status, exc.message, code=exc.code, param=exc.param,
                   reason=exc.reason, headers=exc.headers)


def parse_responses(body: Any) -> TranslatedChat:
    """A Responses body as the chat request it is served as; a 400 naming the Responses
    field at fault, or vLLM's 404 for a ``previous_response_id`` (none is stored)."""
    try:
        return _translated(body)
    except ApiError as exc:
        raise NamedRefusal.of(exc) from None


def _translated(body: Any) -> TranslatedChat:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    shared = {name: body[name] for name in SHARED_FIELDS if name in body}
    own = {name: value for name, value in body.items() if name not in SHARED_FIELDS}
    if "parallel_tool_calls" in shared:
        own["parallel_tool_calls"] = shared["parallel_tool_calls"]
    req: ResponsesRequest = validate(ResponsesRequest, own)
    if req.previous_response_id is not None:
        raise ApiError(404, f"Response with id {shown(req.previous_response_id, 80)} not "
                            f"found: this server keeps no responses (send the conversation "
                            f"in 'input')",
                       code="not_found", param="previous_response_id", reason="not_found")
    try:
        body = req.chat_body(shared)
    except Refusal as exc:  # an item the translation could not read
        raise bad_request(exc.message, exc.param) from None
    try:
        chat = validate(TranslatedChat, body)
    except ApiError as exc:
        raise responses_error(exc) from None
    chat._responses = req
    return chat


def responses_error(exc: ApiError) -> ApiError:
    """A refusal of the chat request (or of the engine's door: a cap over the context),
    naming the Responses field it came from."""
    param = exc.param or ""
    if exc.code == "context_length_exceeded" and param == "prompt":  # not the 'prompt' field
        param = "input"
    root = param.split(".")[0].split("[")[0]
    message = exc.message
    if root in _RESPONSES_NAMES:
        new = _RESPONSES_NAMES[root]
        message = message.replace(f"'{param}'", f"'{new}'").replace(f"'{root}'", f"'{new}'")
        message = _CAP_NAMES.sub("max_output_tokens", message)
        param = new
    elif root == "tools":
        param = param.replace(".function.", ".")
        message = message.replace(".function.", ".")
    exc.param, exc.message = param or None, message
    exc.args = (message,)
    return exc
