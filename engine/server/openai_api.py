"""``POST /v1/completions`` and ``POST /v1/chat/completions``.

One request's story: read -> parse -> tokenize -> effective cap -> reserve (or 429) ->
generate -> answer (JSON or SSE). Parsing, rendering the chat template and tokenizing run
on the server's worker threads, so a 4 MiB body never stalls the event loop; nothing is
reserved until they are done, so a client that leaves meanwhile holds no blocks. The
reservation goes to the engine when the request is added; closing the output stream in
``finally`` aborts an unfinished request (client gone, shutdown, error), and the engine
then returns its blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from kvledger.engine.async_engine import EngineDeadError
from kvledger.engine.errors import BadInput
from kvledger.engine.server.errors import ApiError, bad_request, sse_error_event
from kvledger.engine.server.limits import decode_json
from kvledger.engine.server.protocol import GenerationRequest, parse_chat, parse_completion
from kvledger.engine.server.state import STATE, ServerState

log = logging.getLogger(__name__)


@dataclass
class _Prepared:
    req: GenerationRequest
    request_id: str
    prompt_ids: list[int]
    params: Any
    arrived: float
    created: int


async def completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, parse_completion, "cmpl")


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, parse_chat, "chatcmpl")


async def _serve(request: web.Request, parse, id_prefix: str) -> web.StreamResponse:
    arrived = time.monotonic()
    state = request.app[STATE]
    state.check_accepting()
    raw = await read_body(request)
    req = await state.off_loop(len(raw), _parse, parse, raw)
    state.check_model(req.model)
    prompt = await state.off_loop(len(raw), _prompt, state, req) if req.kind == "chat" else req.prompt
    early = state.admission.early_rejection(_max_prompt_tokens(prompt), req.max_tokens)
    if early is not None:  # a full pool refuses it whatever its exact length
        raise early
    prompt_ids = await state.off_loop(len(raw), _encode, state, req, prompt)
    cap = state.admission.effective_cap(len(prompt_ids), req.max_tokens)
    params = _sampling_params(req, cap)
    p = _Prepared(req, f"{id_prefix}-{uuid.uuid4().hex}", prompt_ids, params, arrived,
                  int(time.time()))
    ticket = await state.admission.admit(p.request_id, len(prompt_ids), cap)
    state.metrics.admitted.inc()
    state.metrics.queue_wait.observe(time.monotonic() - arrived)
    state.metrics.prompt_tokens.inc(len(prompt_ids))
    outputs = None
    try:
        outputs = state.engine.generate(p.request_id, prompt_ids, params, ticket.reservation)
        async with aclosing(outputs):
            if req.stream:
                return await _stream(request, state, p, ticket, outputs)
            return await _whole(state, p, ticket, outputs)
    except EngineDeadError as exc:
        raise ApiError(503, str(exc), code="engine_dead", reason="engine_dead") from None
    except BadInput as exc:
        raise bad_request(str(exc)) from None
    finally:
        if outputs is None:  # never reached the engine: the reservation is still ours
            state.admission.ledger.release(ticket.reservation)
        else:
            last = outputs.last
            done = last is not None and last.finished
            state.metrics.finished.labels(last.finish_reason if done else "abort").inc()
            state.metrics.generation_tokens.inc(len(last.token_ids) if last else 0)
        state.admission.done(ticket)
        state.metrics.latency.observe(time.monotonic() - arrived)


async def read_body(request: web.Request) -> bytes:
    """The whole body within ``--body-timeout`` (else 408, connection closed) and
    ``--max-body-bytes`` (else 413)."""
    options = request.app[STATE].options
    try:
        async with asyncio.timeout(options.body_timeout_s):
            return await request.read()
    except TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {options.body_timeout_s:g}s "
                            f"(--body-timeout)", code="body_timeout", reason="body_timeout") from None
    except web.HTTPRequestEntityTooLarge:
        raise ApiError(413, f"request body is larger than {options.max_body_bytes} bytes",
                       code="body_too_large", reason="body_too_large") from None


def _parse(parse, raw: bytes) -> GenerationRequest:
    return parse(decode_json(raw))


# A tokenizer emits at most one token per UTF-8 byte plus a few it adds itself (BOS, a
# SentencePiece word prefix); this bound lets a full pool refuse before tokenizing. A
# normalizer that expands text (NFKC ligatures) could break it; the cost is only that a
# request which deserved a 413/400 gets a 429 first, and its retry the 413/400.
_ADDED_TOKENS_MAX = 8


def _prompt(state: ServerState, req: GenerationRequest) -> str:
    """A chat rendered as prompt text with the model's template."""
    try:
        return state.llm.tokenizer.apply_chat_template(req.messages, add_generation_prompt=True)
    except BadInput as exc:
        raise bad_request(str(exc), "messages") from None


def _max_prompt_tokens(prompt: str | list[int]) -> int:
    if isinstance(prompt, list):
        return len(prompt)
    return len(prompt.encode()) + _ADDED_TOKENS_MAX


def _encode(state: ServerState, req: GenerationRequest, prompt: str | list[int]) -> list[int]:
    if isinstance(prompt, list):
        try:  # before admission: a request the model cannot run is never counted admitted
            state.llm.check_prompt(prompt)
        except BadInput as exc:
            raise bad_request(str(exc), "prompt") from None
        return prompt
    # A rendered chat template already holds its special tokens (BOS included).
    ids = state.llm.tokenizer.encode(prompt, add_special_tokens=req.kind != "chat")
    if not ids:
        raise bad_request("the prompt encodes to zero tokens", "prompt")
    return ids


def _sampling_params(req: GenerationRequest, cap: int) -> Any:
    from kvledger.engine.sampling_params import SamplingParams

    try:
        return SamplingParams(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                              seed=req.seed, max_tokens=cap, stop=req.stop or None,
                              stop_token_ids=req.stop_token_ids or None,
                              ignore_eos=req.ignore_eos)
    except BadInput as exc:
        raise bad_request(str(exc)) from None


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


async def _whole(state: ServerState, p: _Prepared, ticket, outputs) -> web.Response:
    final = None
    async for output in outputs:
        if final is None and output.token_ids:
            state.metrics.ttft.observe(time.monotonic() - p.arrived)
        final = output
        state.admission.progress(ticket, len(output.token_ids))
    if final.finish_reason == "error":  # the engine failed this request alone
        raise ApiError(500, _failed_message(final), code="request_error",
                       reason="request_error")
    completion_tokens = len(final.token_ids)
    if p.req.kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": final.text},
                  "logprobs": None, "finish_reason": final.finish_reason}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": final.text, "logprobs": None,
                  "finish_reason": final.finish_reason}
        obj = "text_completion"
    return web.json_response({"id": p.request_id, "object": obj, "created": p.created,
                              "model": p.req.model, "choices": [choice],
                              "usage": _usage(len(p.prompt_ids), completion_tokens)})


async def _stream(request: web.Request, state: ServerState, p: _Prepared, ticket,
                  outputs) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
    try:
        await response.prepare(request)
    except ConnectionError:  # gone before the headers: aclosing() aborts the request
        return response
    chat = p.req.kind == "chat"
    obj = "chat.completion.chunk" if chat else "text_completion"

    def chunk(delta: str | None, finish_reason: str | None, role: bool = False) -> bytes:
        if chat:
            content: dict[str, Any] = {"role": "assistant"} if role else {}
            if delta is not None:
                content["content"] = delta
            choice = {"index": 0, "delta": content, "logprobs": None,
                      "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": delta or "", "logprobs": None,
                      "finish_reason": finish_reason}
        return _sse({"id": p.request_id, "object": obj, "created": p.created,
                     "model": p.req.model, "choices": [choice]})

    sent_text = ""
    completion_tokens = 0
    try:
        if chat:
            await response.write(chunk("", None, role=True))
        async for output in outputs:
            if completion_tokens == 0 and output.token_ids:
                state.metrics.ttft.observe(time.monotonic() - p.arrived)
            completion_tokens = len(output.token_ids)
            state.admission.progress(ticket, completion_tokens)
            delta = ""
            if output.text.startswith(sent_text):  # text already sent is never retracted
                delta, sent_text = output.text[len(sent_text):], output.text
            if output.finished and output.finish_reason == "error":
                await _end_with_error(state, response, 500, _failed_message(output),
                                      "request_error")
                return response
            if output.finished:
                if delta:
                    await response.write(chunk(delta, None))
                await response.write(chunk(None if chat else "", output.finish_reason))
            elif delta:
                await response.write(chunk(delta, None))
        if p.req.include_usage:
            await response.write(_sse({"id": p.request_id, "object": obj, "created": p.created,
                                       "model": p.req.model, "choices": [],
                                       "usage": _usage(len(p.prompt_ids), completion_tokens)}))
        await response.write(b"data: [DONE]\n\n")
    except ConnectionError:  # the client went away; aclosing() aborts the request
        pass
    except EngineDeadError as exc:
        await _end_with_error(state, response, 503, str(exc), "engine_dead")
    except Exception:  # a bug after the 200 went out: the stream's last event says so
        log.exception("unhandled error while streaming %s", p.request_id)
        await _end_with_error(state, response, 500, "internal server error", "internal_error")
    return response


async def _end_with_error(state: ServerState, response: web.StreamResponse, status: int,
                          message: str, code: str) -> None:
    """A failure after the headers (status 200) went out: an error event, then ``[DONE]``
    so clients' stream readers end normally. Counted here, as the app's middleware counts
    those that still get their own status."""
    state.metrics.count_failure(code)
    with contextlib.suppress(ConnectionError):
        await response.write(sse_error_event(status, message, code))
        await response.write(b"data: [DONE]\n\n")


def _failed_message(output) -> str:
    return f"the engine failed this request ({output.error}); other requests are unaffected"


def _sse(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"
