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
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from kvledger.engine.async_engine import EngineDeadError
from kvledger.engine.errors import BadInput
from kvledger.engine.server.errors import ApiError, bad_request, sse_error_event
from kvledger.engine.server.limits import decode_json
from kvledger.engine.server.logprobs import chat_logprobs, completion_logprobs
from kvledger.engine.server.protocol import GenerationRequest, parse_chat, parse_completion
from kvledger.engine.server.state import STATE, ServerState

log = logging.getLogger(__name__)


@dataclass
class _Prepared:
    req: GenerationRequest
    request_id: str
    prompt_ids: list[int]
    echo: str | None          # completions' ``echo``: the prompt's text, else None
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
    early = state.admission.early_rejection(_max_prompt_tokens(prompt), req.cap, req.n)
    if early is not None:  # a full pool refuses it whatever its exact length
        raise early
    prompt_ids = await state.off_loop(len(raw), _encode, state, req, prompt)
    cap = state.admission.effective_cap(len(prompt_ids), req.cap)
    grammar = await _grammar(state, req)
    params = [_sampling_params(req, cap, grammar, i) for i in range(req.n)]
    try:  # before admission: token ids the model lacks (logit_bias) are a 400
        state.llm.check_params(params[0])
    except BadInput as exc:
        raise bad_request(str(exc), "logit_bias") from None
    echo = None
    if req.kind == "completion" and req.echo:
        echo = prompt if isinstance(prompt, str) else state.llm.tokenizer.decode(prompt_ids)
    p = _Prepared(req, f"{id_prefix}-{uuid.uuid4().hex}", prompt_ids, echo, arrived,
                  int(time.time()))
    ticket = await state.admission.admit(p.request_id, len(prompt_ids), cap, req.n,
                                         prompt_token_ids=prompt_ids,
                                         use_cached=params[0].prompt_logprobs is None)
    state.metrics.admitted.inc()
    state.metrics.queue_wait.observe(time.monotonic() - arrived)
    state.metrics.prompt_tokens.inc(len(prompt_ids))
    streams: list = []
    try:
        for i, reservation in enumerate(ticket.reservations):
            choice_id = p.request_id if req.n == 1 else f"{p.request_id}-{i}"
            streams.append(state.engine.generate(choice_id, prompt_ids, params[i], reservation))
        async with aclosing(_merged(streams)) as outputs:
            if req.stream:
                return await _stream(request, state, p, ticket, outputs)
            return await _whole(state, p, ticket, outputs)
    except EngineDeadError as exc:
        raise ApiError(503, str(exc), code="engine_dead", reason="engine_dead") from None
    except BadInput as exc:
        raise bad_request(str(exc)) from None
    finally:
        # The engine owns what it was handed (closing a stream aborts it); the rest is
        # still ours. A release of one ``generate`` already released does nothing.
        for reservation in ticket.reservations[len(streams):]:
            state.admission.ledger.release(reservation)
        for stream in streams:
            await stream.aclose()
            last = stream.last
            done = last is not None and last.finished
            state.metrics.finished.labels(last.finish_reason if done else "abort").inc()
            state.metrics.generation_tokens.inc(len(last.token_ids) if last else 0)
        state.admission.done(ticket)
        state.metrics.latency.observe(time.monotonic() - arrived)


async def _merged(streams: list) -> AsyncIterator[tuple[int, Any]]:
    """``(choice index, output)`` from every choice's stream as they come."""
    if len(streams) == 1:
        async for output in streams[0]:
            yield 0, output
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream) -> None:
        try:
            async for output in stream:
                queue.put_nowait((index, output))
        except Exception as exc:  # the engine died: the merged stream raises it
            queue.put_nowait((index, exc))
        else:
            queue.put_nowait((index, None))

    tasks = [asyncio.create_task(pump(i, stream)) for i, stream in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            index, item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()


async def read_body(request: web.Request) -> bytes:
    """The whole body within ``--body-timeout`` (else 408, connection closed) and
    ``--max-body-bytes`` (else 413)."""
    options = request.app[STATE].options
    try:
        if request.content.is_eof():  # it came with the headers: nothing to wait for
            return await request.read()
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
        return state.llm.tokenizer.apply_chat_template(
            req.template_messages, add_generation_prompt=req.add_generation_prompt)
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


def _sampling_params(req: GenerationRequest, cap: int, grammar: Any, index: int) -> Any:
    from kvledger.engine.sampling_params import SamplingParams

    seed = req.seed
    if seed is not None and index:  # each choice draws its own tokens, reproducibly
        seed = (seed + index) % 2**64
    try:
        return SamplingParams(
            temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, seed=seed,
            max_tokens=cap, stop=req.stop or None, stop_token_ids=req.stop_token_ids,
            ignore_eos=req.ignore_eos, presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            repetition_penalty=req.repetition_penalty, min_tokens=req.min_tokens,
            logit_bias=req.bias, logprobs=req.logprobs_k(),
            prompt_logprobs=req.prompt_logprobs_k(),
            include_stop_str_in_output=req.include_stop_str_in_output, grammar=grammar)
    except BadInput as exc:
        raise bad_request(str(exc)) from None


_CONSTRAINTS = ("response_format", "structured_outputs", "guided_json", "guided_regex",
                "guided_choice")


async def _grammar(state: ServerState, req: GenerationRequest) -> Any:
    """The compiled output constraint, or None. Compiling a schema can take milliseconds
    (cached after the first time), so it runs on a worker thread."""
    spec = req.grammar()
    if spec is None:
        return None
    from kvledger.engine.grammar import GrammarError, GrammarSpec

    try:
        return await state.off_loop(None, state.grammars.compile, GrammarSpec(*spec))
    except GrammarError as exc:
        param = next(name for name in _CONSTRAINTS if getattr(req, name) is not None)
        raise bad_request(str(exc), param) from None


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


async def _whole(state: ServerState, p: _Prepared, ticket, outputs) -> web.Response:
    finals: list = [None] * p.req.n
    counts = [0] * p.req.n
    async for index, output in outputs:
        if not any(counts) and output.token_ids:
            state.metrics.ttft.observe(time.monotonic() - p.arrived)
        finals[index], counts[index] = output, len(output.token_ids)
        state.admission.progress(ticket, min(counts))
    failed = next((f for f in finals if f.finish_reason == "error"), None)
    if failed is not None:  # the engine failed this request alone
        raise ApiError(500, _failed_message(failed), code="request_error",
                       reason="request_error")
    chat = p.req.kind == "chat"
    choices = [_chat_choice(state, p, i, f) if chat else _completion_choice(state, p, i, f)
               for i, f in enumerate(finals)]
    return web.json_response({"id": p.request_id,
                              "object": "chat.completion" if chat else "text_completion",
                              "created": p.created, "model": p.req.model, "choices": choices,
                              "usage": _usage(len(p.prompt_ids), sum(counts))})


def _chat_choice(state: ServerState, p: _Prepared, index: int, final) -> dict[str, Any]:
    logprobs = None
    if final.logprobs is not None:
        logprobs = chat_logprobs(zip(final.token_ids, final.logprobs, strict=True),
                                 _token_text(state, p.req))
    return {"index": index, "message": {"role": "assistant", "content": final.text},
            "logprobs": logprobs, "finish_reason": final.finish_reason}


def _completion_choice(state: ServerState, p: _Prepared, index: int, final) -> dict[str, Any]:
    return {"index": index, "text": (p.echo or "") + final.text,
            "logprobs": _completion_logprobs(state, p, final, 0, True),
            "finish_reason": final.finish_reason}


def _completion_logprobs(state: ServerState, p: _Prepared, output, sent: int,
                         with_prompt: bool) -> dict[str, list] | None:
    """Output tokens ``sent:`` (and the prompt's, for ``echo``) in the completions shape."""
    if output.logprobs is None:
        return None
    entries = list(zip(output.token_ids[sent:], output.logprobs[sent:], strict=True))
    if with_prompt and output.prompt_logprobs is not None:
        entries = list(zip(p.prompt_ids, output.prompt_logprobs, strict=True)) + entries
    return completion_logprobs(entries, _token_text(state, p.req))


def _token_text(state: ServerState, req: GenerationRequest):
    """How logprobs name a token: its text, or vLLM's ``token_id:N`` when asked."""
    return _token_id_text if req.return_tokens_as_token_ids else state.token_text


def _token_id_text(token_id: int) -> str:
    return f"token_id:{token_id}"


@dataclass
class _ChoiceStream:
    """What one choice of a stream has sent so far."""

    text: str = ""
    tokens: int = 0
    logprobs: int = 0
    started: bool = False


async def _stream(request: web.Request, state: ServerState, p: _Prepared, ticket,
                  outputs) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
    try:
        await response.prepare(request)
    except ConnectionError:  # gone before the headers: aclosing() aborts the request
        return response
    req = p.req
    chat = req.kind == "chat"
    obj = "chat.completion.chunk" if chat else "text_completion"
    sent = [_ChoiceStream() for _ in range(req.n)]

    def event(choices: list[dict[str, Any]], usage: bool = False) -> bytes:
        payload = {"id": p.request_id, "object": obj, "created": p.created, "model": req.model,
                   "choices": choices}
        if usage:
            payload["usage"] = _usage(len(p.prompt_ids), sum(c.tokens for c in sent))
        return _sse(payload)

    def chunk(index: int, delta: str | None, finish_reason: str | None,
              logprobs: Any = None, role: bool = False) -> bytes:
        if chat:
            content: dict[str, Any] = {"role": "assistant"} if role else {}
            if delta is not None:
                content["content"] = delta
            choice = {"index": index, "delta": content, "logprobs": logprobs,
                      "finish_reason": finish_reason}
        else:
            choice = {"index": index, "text": delta or "", "logprobs": logprobs,
                      "finish_reason": finish_reason}
        return event([choice], usage=req.continuous_usage)

    try:
        if chat:
            for index in range(req.n):
                await response.write(chunk(index, "", None, role=True))
        async for index, output in outputs:
            choice = sent[index]
            if not any(c.tokens for c in sent) and output.token_ids:
                state.metrics.ttft.observe(time.monotonic() - p.arrived)
            choice.tokens = len(output.token_ids)
            state.admission.progress(ticket, min(c.tokens for c in sent))
            if output.finished and output.finish_reason == "error":
                await _end_with_error(state, response, 500, _failed_message(output),
                                      "request_error")
                return response
            delta = ""
            if output.text.startswith(choice.text):  # text already sent is never retracted
                delta, choice.text = output.text[len(choice.text):], output.text
            if not choice.started and p.echo is not None:
                delta = p.echo + delta
            logprobs = None
            if output.logprobs is not None and len(output.logprobs) > choice.logprobs:
                logprobs = (chat_logprobs(zip(output.token_ids[choice.logprobs:],
                                              output.logprobs[choice.logprobs:], strict=True),
                                          _token_text(state, req)) if chat
                            else _completion_logprobs(state, p, output, choice.logprobs,
                                                      not choice.started))
                choice.logprobs = len(output.logprobs)
            choice.started = True
            if delta or logprobs is not None:
                await response.write(chunk(index, delta, None, logprobs))
            if output.finished:
                await response.write(chunk(index, None if chat else "", output.finish_reason))
        if req.include_usage:
            await response.write(event([], usage=True))
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
