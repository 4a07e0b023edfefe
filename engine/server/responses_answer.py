"""A Responses request's outputs as the ``response`` object vLLM 0.32 builds
(``ResponsesResponse.from_request``): its ``output`` items (a ``reasoning`` item with
``--reasoning-parser``, an assistant ``message`` with ``output_text``, then a
``function_call`` item per call), ``status`` (``incomplete`` with
``incomplete_details.reason: "max_output_tokens"`` when the cap cut it), the ``usage`` in
the Responses names, and the request's parameters echoed (the sampling values in
effect). ``whole`` answers once; ``responses_stream`` sends the same items as events.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from aiohttp import web

from kvledger.engine.server.answers import Prepared, failed_message, token_text
from kvledger.engine.server.api_errors import ApiError
from kvledger.engine.server.logprobs import chat_logprobs
from kvledger.engine.server.reasoning import ReasoningSplitter
from kvledger.engine.server.responses_fields import NamedFunction
from kvledger.engine.server.responses_request import TranslatedChat
from kvledger.engine.server.state import ServerState
from kvledger.engine.server.tools.parsers import ToolCall


def item_id(prefix: str) -> str:
    """An output item's id: ``msg_...`` a message's, ``fc_...`` a function call's,
    ``rs_...`` a reasoning item's."""
    return f"{prefix}_{uuid.uuid4().hex}"


def text_part(text: str, logprobs: list[dict[str, Any]] | None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}


def message_item(msg_id: str, text: str, logprobs: list[dict[str, Any]] | None,
                 status: str = "completed") -> dict[str, Any]:
    """The assistant's message; no content part when it wrote no text (vLLM's)."""
    content = [text_part(text, logprobs)] if text else []
    return {"id": msg_id, "type": "message", "role": "assistant", "status": status,
            "content": content}


def reasoning_part(text: str) -> dict[str, Any]:
    return {"type": "reasoning_text", "text": text}


def reasoning_item(rs_id: str, text: str | None, status: str = "completed") -> dict[str, Any]:
    """vLLM's reasoning item for a model without Harmony; ``text`` None: no content yet
    (the item a stream opens). Its ``status`` is ``completed`` once written, as vLLM's
    stream closes it, whole answers too (vLLM's whole answer leaves it null), so that a
    stream adds up to the whole answer."""
    return {"id": rs_id, "type": "reasoning", "summary": [],
            "content": None if text is None else [reasoning_part(text)],
            "encrypted_content": None, "status": status}


def call_item(fc_id: str, call: ToolCall, status: str = "completed") -> dict[str, Any]:
    return {"id": fc_id, "type": "function_call", "call_id": call.id, "name": call.name,
            "arguments": call.arguments, "status": status}


def logprob_entries(state: ServerState, p: Prepared, token_ids: list[int],
                    logprobs: list | None) -> list[dict[str, Any]] | None:
    """Output tokens' logprobs as ``output_text.logprobs`` (chat's entries: token,
    logprob, bytes, top_logprobs); None unless ``include`` asked for them."""
    if logprobs is None:
        return None
    entries = zip(token_ids, logprobs, strict=True)
    return chat_logprobs(entries, token_text(state, p.req))["content"]


def status_of(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def response_object(p: Prepared, status: str, output: list[dict[str, Any]],
                    output_tokens: int | None, reasoning_tokens: int = 0) -> dict[str, Any]:
    """The ``response`` object, as vLLM's ``from_request`` fills it; ``output_tokens``
    None: no usage yet (a stream's first events)."""
    chat: TranslatedChat = p.req
    req = chat.responses
    params = p.generation.runs[0].choices[0].params
    choice = req.effective_tool_choice
    return {
        "id": p.request_id, "object": "response", "created_at": p.created,
        "status": status, "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": req.instructions, "metadata": req.metadata, "model": chat.model,
        "output": output, "parallel_tool_calls": req.parallel_tool_calls,
        "temperature": params.temperature, "top_p": params.top_p,
        "presence_penalty": params.presence_penalty,
        "frequency_penalty": params.frequency_penalty,
        "tool_choice": choice.model_dump() if isinstance(choice, NamedFunction) else choice,
        "tools": [tool.model_dump(by_alias=True) for tool in req.tools or ()],
        "background": False, "max_output_tokens": p.generation.runs[0].cap_tokens,
        "max_tool_calls": req.max_tool_calls, "previous_response_id": None, "prompt": None,
        "reasoning": req.reasoning.model_dump() if req.reasoning is not None else None,
        "service_tier": req.service_tier,
        "text": req.text.model_dump(by_alias=True, exclude_none=True) if req.text else None,
        "top_logprobs": params.logprobs, "truncation": req.truncation, "user": chat.user,
        "usage": None if output_tokens is None else usage(p, output_tokens, reasoning_tokens),
    }


def finished_response(p: Prepared, final, output: list[dict[str, Any]],
                      splitter: ReasoningSplitter | None) -> dict[str, Any]:
    """The response object of a finished answer: its ``output`` items, the status its
    last output says, the usage with the reasoning tokens ``splitter`` read."""
    reasoning_tokens = 0 if splitter is None else p.reasoning.usage_details(
        [splitter], [final.token_ids])["reasoning_tokens"]
    return response_object(p, status_of(final.finish_reason), output, len(final.token_ids),
                           reasoning_tokens)


def usage(p: Prepared, output_tokens: int, reasoning_tokens: int = 0) -> dict[str, Any]:
    """The Responses usage; cached tokens are counted only with
    ``--enable-prompt-tokens-details`` (as chat's are: they tell what other requests
    left in the cache), else 0."""
    input_tokens = p.generation.prompt_tokens
    return {"input_tokens": input_tokens,
            "input_tokens_details": {"cached_tokens": p.cached_tokens or 0},
            "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": input_tokens + output_tokens}


async def whole(state: ServerState, p: Prepared, outputs) -> web.Response:
    """The whole ``response`` in one JSON body."""
    final = None
    async for _, output in outputs:
        final = output
        p.progress([len(output.token_ids)])
    if final.finish_reason == "error":  # the engine failed this request alone
        raise ApiError(500, failed_message(final), code="request_error",
                       reason="request_error")
    splitter = None if p.reasoning is None else p.reasoning.splitter()
    output = output_items(state, p, final, splitter)
    body = finished_response(p, final, output, splitter)
    return web.Response(body=json.dumps(body), content_type="application/json",
                        charset="utf-8")


def output_items(state: ServerState, p: Prepared, final,
                 splitter: ReasoningSplitter | None = None) -> list[dict[str, Any]]:
    """A finished answer's items: its reasoning (``--reasoning-parser``, unless
    ``include_reasoning`` is false), its text as a message (when there is text, or no
    other item, as vLLM's stream sends them), then its calls, read as a stream reads them
    (``CallScanner``)."""
    text, calls, reasoning = final.text, [], []
    if splitter is not None:
        splitter.feed(final.text, final.token_ids, final=True)
        text = splitter.content
        if splitter.reasoning and p.reasoning.include:
            reasoning = [reasoning_item(item_id("rs"), splitter.reasoning)]
    scanner = p.tools.scanner()
    if scanner is not None:
        scanner.feed(text, final=True)
        text, calls = scanner.content, scanner.calls
    logprobs = logprob_entries(state, p, final.token_ids,
                               final.logprobs if p.shows_logprobs else None)
    message = text or not (calls or reasoning)
    items = [message_item(item_id("msg"), text, logprobs)] if message else []
    return reasoning + items + [call_item(item_id("fc"), call) for call in calls]
