"""vLLM's ``POST /tokenize``, ``POST /detokenize`` and ``GET /version``.

``/tokenize`` takes a completions ``prompt`` or a chat's ``messages`` (rendered with the
model's template, as a chat request would be) and answers the token ids the engine
would run, with the context limit: a client can size ``max_tokens`` before it asks.
Nothing is reserved.
"""

from __future__ import annotations

import json
from importlib.metadata import version as package_version
from typing import Annotated, Any

from aiohttp import web
from pydantic import Field, field_validator, model_validator

from kvledger.engine.errors import BadInput
from kvledger.engine.server.api_errors import bad_request
from kvledger.engine.server.chat_message import ChatMessage
from kvledger.engine.server.chat_options import ChatTemplateOptions
from kvledger.engine.server.limits import MAX_INT, decode_json, few_messages
from kvledger.engine.server.openai_api import read_body
from kvledger.engine.server.request_fields import render_chat, render_size
from kvledger.engine.server.state import STATE, ServerState
from kvledger.engine.server.tools.protocol import ToolList, template_tools
from kvledger.engine.server.validation import Strict, validate


class TokenizeRequest(ChatTemplateOptions):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: ToolList | None = None            # vLLM's: rendered by the chat template too
    add_special_tokens: bool | None = None   # default: True for a prompt, False for a chat
    return_token_strs: bool = False

    _message_count = field_validator("messages", mode="before")(few_messages)

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' or 'messages'")
        if self.tools is not None and self.messages is None:
            raise ValueError("'tools' are rendered with 'messages' only")
        return self


class DetokenizeRequest(Strict):
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0, le=MAX_INT)]]


async def tokenize(request: web.Request) -> web.Response:
    state, req, size = await _read(request, TokenizeRequest)
    # Off the loop by the body's size (the answer is up to 8 bytes of JSON a prompt byte:
    # its ids and their strings), always with the request's own template.
    body = await state.off_loop(render_size(size, req), _tokenized, state, req)
    return web.Response(body=body, content_type="application/json")


def _tokenized(state, req: TokenizeRequest) -> bytes:
    """The answer's JSON: the ids, and with ``return_token_strs`` the vocabulary's strings
    (vLLM's convert_ids_to_tokens)."""
    ids = _tokenize(state, req)
    tokenizer = state.door.tokenizer
    strs = [tokenizer.id_to_token(t) or "" for t in ids] if req.return_token_strs else None
    return json.dumps({"count": len(ids), "max_model_len": state.served.max_model_len,
                       "tokens": ids, "token_strs": strs}).encode()


async def detokenize(request: web.Request) -> web.Response:
    state, req, size = await _read(request, DetokenizeRequest)
    try:
        state.served.check_prompt_ids(req.tokens or [0])
    except BadInput as exc:
        raise bad_request(str(exc), "tokens") from None
    # Special tokens kept, as vLLM's (transformers' decode keeps them by default).
    text = await state.off_loop(size, state.door.tokenizer.decode, req.tokens, False)
    return web.json_response({"prompt": text})


async def version(request: web.Request) -> web.Response:
    return web.json_response({"version": package_version("kvledger")})


async def _read(request: web.Request, model) -> tuple[ServerState, Any, int]:
    """(state, the validated body, its size) of a request the server can take now."""
    state = request.app[STATE]
    state.check_accepting()
    raw = await read_body(request)
    req = await state.off_loop(len(raw), _parse, model, raw)
    if req.model is not None:
        state.check_model(req.model)
    return state, req, len(raw)


def _parse(model, raw: bytes):
    return validate(model, decode_json(raw))


def _tokenize(state, req: TokenizeRequest) -> list[int]:
    tokenizer = state.door.tokenizer
    if req.messages is not None:
        text = render_chat(state, req, [m.as_template_input() for m in req.messages],
                           template_tools(req.tools))
        return tokenizer.encode(text, add_special_tokens=bool(req.add_special_tokens))
    special = True if req.add_special_tokens is None else req.add_special_tokens
    return tokenizer.encode(req.prompt, add_special_tokens=special)
