"""vLLM's ``GET /tokenizer_info`` (``--enable-tokenizer-info-endpoint``): the tokenizer's
configuration, as ``tokenizer_config.json`` gives it, and the chat template.

vLLM answers its tokenizer's ``init_kwargs`` (``tokenizer_config.json`` as transformers
read it) less ``vocab_file`` and ``merges_file``, each added token (transformers'
``AddedToken``) as its text, ``tokenizer_class`` and, with ``--chat-template``, that
template. Here: the file's keys less those two, a token written as an ``AddedToken``
object (``{"content": ..., "__type": "AddedToken"}``, and each entry of
``added_tokens_decoder``) as its text, ``tokenizer_class`` the class the file names
(vLLM's is its Python class's name, ``PreTrainedTokenizerFast`` here for a file that
names none), and ``chat_template`` the template chats are rendered with (``--chat-template``,
else the model's), where there is one. Served behind the API key, as ``/tokenize`` is; it
holds nothing a request sent.
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from kvledger.engine.server.state import STATE

PATH = "/tokenizer_info"
# Paths to the files the tokenizer was read from, which vLLM leaves out.
_DROPPED = ("vocab_file", "merges_file")
DEFAULT_CLASS = "PreTrainedTokenizerFast"  # transformers' class for a bare tokenizer.json


def tokenizer_info(tokenizer_config: dict[str, Any], chat_template: str | None) -> dict[str, Any]:
    """The answer's JSON object (module docstring) for a tokenizer read with
    ``tokenizer_config`` (``tokenizer_config.json``'s object) that renders chats with
    ``chat_template`` (None: none)."""
    info = {key: _as_text(value) for key, value in tokenizer_config.items()
            if key not in _DROPPED}
    named = tokenizer_config.get("tokenizer_class")
    info["tokenizer_class"] = named if isinstance(named, str) and named else DEFAULT_CLASS
    if chat_template:
        info["chat_template"] = chat_template
    return info


def _as_text(value: Any) -> Any:
    """``value`` with each token written as an object (its ``content``, as transformers
    reads it into an ``AddedToken``) as its text, at any depth."""
    if isinstance(value, dict):
        if isinstance(value.get("content"), str) and (
                value.get("__type") == "AddedToken" or "special" in value):
            return value["content"]
        return {key: _as_text(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_as_text(item) for item in value]
    return value


# The answer's body, built at its first request (once loaded; neither changes after): a
# config with thousands of added tokens is not walked and encoded at every request.
_BODY = web.AppKey("kvledger_tokenizer_info", list)


def add_route(app: web.Application) -> None:
    app[_BODY] = []
    app.router.add_get(PATH, get_tokenizer_info)


async def get_tokenizer_info(request: web.Request) -> web.Response:
    tokenizer = request.app[STATE].check_accepting().tokenizer
    built = request.app[_BODY]
    if not built:
        info = tokenizer_info(tokenizer.tokenizer_config, tokenizer.chat_template)
        built.append(json.dumps(info).encode())
    return web.Response(body=built[0], content_type="application/json")
