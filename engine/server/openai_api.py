"""``POST /v1/completions`` and ``POST /v1/chat/completions``.

One request's story: parse -> tokenize -> effective cap -> reserve (or 429) -> generate
-> answer (JSON or SSE). The reservation goes to the engine when the request is added;
closing the output stream in ``finally`` aborts an unfinished request (client gone,
shutdown, error), and the engine then returns its blocks.
"""

from __future__ import annotations

import contextlib
import json
import re
import time
import uuid
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from kvledger.engine.async_engine import EngineDeadError
from kvledger.engine.errors import BadInput
from kvledger.engine.server.errors import ApiError, bad_request, sse_error_event
from kvledger.engine.server.protocol import GenerationRequest, parse_chat, parse_completion
from kvledger.engine.server.state import STATE, ServerState


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
    req = parse(await read_json(request))
    state.check_model(req.model)
    prompt = _prompt(state, req)
    early = state.admission.early_rejection(_max_prompt_tokens(prompt), req.max_tokens)
    if early is not None:  # a full pool refuses it whatever its exact length
        raise early
    prompt_ids = _encode(state, req, prompt)
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


async def read_json(request: web.Request) -> Any:
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        limit = request.app[STATE].options.max_body_bytes
        raise ApiError(413, f"request body is larger than {limit} bytes",
                       code="body_too_large", reason="body_too_large") from None
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as exc:
        raise bad_request(f"invalid JSON body: {exc}", code="invalid_json") from None
    # JSON may escape half a surrogate pair (\ud800), which no UTF-8 text can hold: the
    # tokenizer and every response would fail on it. Only an escape can produce one.
    if _SURROGATE_ESCAPE.search(raw) and _has_lone_surrogate(body):
        raise bad_request("invalid JSON body: a string holds an unpaired UTF-16 surrogate "
                          "escape (\\ud800-\\udfff)", code="invalid_json")
    return body


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _has_lone_surrogate(value: Any) -> bool:
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return True
        return False
    if isinstance(value, dict):
        return any(_has_lone_surrogate(k) or _has_lone_surrogate(v) for k, v in value.items())
    if isinstance(value, list):
        return any(_has_lone_surrogate(v) for v in value)
    return False


# A tokenizer emits at most one token per UTF-8 byte plus a few it adds itself (BOS, a
# SentencePiece word prefix); this bound lets a full pool refuse before tokenizing. A
# normalizer that expands text (NFKC ligatures) could break it; the cost is only that a
# request which deserved a 413/400 gets a 429 first, and its retry the 413/400.
_ADDED_TOKENS_MAX = 8


def _prompt(state: ServerState, req: GenerationRequest) -> str | list[int]:
    """The prompt as text (a chat rendered with the model's template) or token ids."""
    if req.kind != "chat":
        return req.prompt
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
    except EngineDeadError as exc:
        with contextlib.suppress(ConnectionError):
            await response.write(sse_error_event(503, str(exc), "engine_dead"))
    except ConnectionError:  # the client went away; aclosing() aborts the request
        pass
    return response


def _sse(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"
