"""A request's outputs as OpenAI's answer: one JSON body, or Server-Sent Events.

``whole`` waits for every choice and answers once; ``stream`` writes each choice's new
text (and its logprobs) as the engine produces it, then the usage and ``[DONE]``. A
failure after the headers went out ends the stream with an error event and ``[DONE]``,
so clients' stream readers end normally.
"""

from __future__ import annotations

import contextlib
import json
import logging
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from kvledger.engine.errors import EngineDeadError
from kvledger.engine.frontend.generation import Generation
from kvledger.engine.server.api_errors import ApiError, sse_error_event
from kvledger.engine.server.logprobs import chat_logprobs, completion_logprobs
from kvledger.engine.server.metrics import RequestTimeline
from kvledger.engine.server.protocol import GenerationRequest
from kvledger.engine.server.state import ServerState
from kvledger.engine.server.tools.calls import NO_TOOLS, ToolPlan
from kvledger.engine.server.tools.parsers import ArgumentsDelta, CallScanner, ToolCall

log = logging.getLogger(__name__)


@dataclass
class Prepared:
    """A request admitted at the engine's door: what its answer is built from. Choice
    ``k`` answers prompt ``k // n`` (OpenAI's and vLLM's indices)."""

    req: GenerationRequest
    request_id: str
    generation: Generation     # its prompts' runs and their outputs
    timeline: RequestTimeline  # its measurement points, for the metrics
    created: int
    tools: ToolPlan = NO_TOOLS  # how a chat's tool calls are read from its text
    echoes: list[str | None] = field(default_factory=list)  # completions' echo, a prompt each
    # Prompt tokens found in the prefix cache, reported as usage.prompt_tokens_details
    # (--enable-prompt-tokens-details); None: not reported.
    cached_tokens: int | None = None

    @property
    def num_choices(self) -> int:
        return self.generation.num_choices

    def prompt_ids(self, index: int) -> list[int]:
        """The prompt choice ``index`` answers."""
        return self.generation.runs[index // self.req.n].prompt_ids

    def echo(self, index: int) -> str | None:
        return self.echoes[index // self.req.n] if self.echoes else None

    def progress(self, counts: list[int]) -> None:
        """How far each choice has got (``counts``: its tokens), for the request's timeline
        and the line's estimates."""
        self.timeline.generated(sum(counts))
        self.generation.progress(counts)


def _usage(p: Prepared, completion_tokens: int) -> dict[str, Any]:
    prompt_tokens = p.generation.prompt_tokens
    usage: dict[str, Any] = {"prompt_tokens": prompt_tokens,
                             "completion_tokens": completion_tokens,
                             "total_tokens": prompt_tokens + completion_tokens}
    if p.cached_tokens is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": p.cached_tokens}
    return usage


async def whole(state: ServerState, p: Prepared, outputs) -> web.Response:
    finals: list = [None] * p.num_choices
    counts = [0] * p.num_choices
    async for index, output in outputs:
        finals[index], counts[index] = output, len(output.token_ids)
        p.progress(counts)
    if p.req.echo_only:  # the token computed for the prompt's logprobs is not an answer
        counts = [0] * p.num_choices
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
                              "usage": _usage(p, sum(counts))})


def _chat_choice(state: ServerState, p: Prepared, index: int, final) -> dict[str, Any]:
    logprobs = None
    if final.logprobs is not None:
        logprobs = chat_logprobs(zip(final.token_ids, final.logprobs, strict=True),
                                 _token_text(state, p.req))
    message: dict[str, Any] = {"role": "assistant", "content": final.text}
    scanner = p.tools.scanner()
    if scanner is not None:  # the same reading a stream makes, all at once
        scanner.feed(final.text, final=True)
        message["content"] = scanner.content or (None if scanner.calls else "")
        if scanner.calls:
            message["tool_calls"] = [call.as_openai() for call in scanner.calls]
    return {"index": index, "message": message, "logprobs": logprobs,
            "finish_reason": _finish_reason(final.finish_reason, scanner, p.tools),
            "stop_reason": final.stop_reason}


def _finish_reason(reason: str | None, scanner: CallScanner | None,
                   tools: ToolPlan) -> str | None:
    """OpenAI's ``calls`` when the model stopped after calling as it chose (``auto`` or
    ``required``); ``stop`` for a function the request named, as OpenAI and vLLM answer;
    else the engine's."""
    if reason == "stop" and scanner is not None and scanner.calls and not tools.named:
        return "tool_calls"
    return reason


def _completion_choice(state: ServerState, p: Prepared, index: int, final) -> dict[str, Any]:
    text = "" if p.req.echo_only else final.text
    return {"index": index, "text": (p.echo(index) or "") + text,
            "logprobs": _completion_logprobs(state, p, index, final, 0, 0)[0],
            "finish_reason": final.finish_reason, "stop_reason": final.stop_reason}


def _completion_logprobs(state: ServerState, p: Prepared, index: int, output, sent: int,
                         offset: int) -> tuple[dict[str, list] | None, int]:
    """Output tokens ``sent:`` (and the prompt's, for ``echo``, when ``sent`` is 0) in the
    completions shape, the first token's text at ``offset`` in the choice's text; and the
    offset after the last. Only the prompt's when the request echoes it alone."""
    if output.logprobs is None:
        return None, offset
    entries = [] if p.req.echo_only else list(
        zip(output.token_ids[sent:], output.logprobs[sent:], strict=True))
    if sent == 0 and output.prompt_logprobs is not None:
        entries = list(zip(p.prompt_ids(index), output.prompt_logprobs, strict=True)) + entries
    logprobs = completion_logprobs(entries, _token_text(state, p.req), offset)
    if logprobs["tokens"]:
        offset = logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])
    return logprobs, offset


def _token_text(state: ServerState, req: GenerationRequest):
    """How logprobs name a token: its text, or vLLM's ``token_id:N`` when asked."""
    return (_token_id_text if req.return_tokens_as_token_ids
            or state.options.return_tokens_as_token_ids else state.token_text)


def _token_id_text(token_id: int) -> str:
    return f"token_id:{token_id}"


@dataclass
class _ChoiceStream:
    """What one choice of a stream has sent so far."""

    text: str = ""
    tokens: int = 0
    logprobs: int = 0
    offset: int = 0  # where the next logprob's token starts in the text sent (text_offset)
    started: bool = False
    scanner: CallScanner | None = None  # a chat with tools: reads calls from the text


async def stream(request: web.Request, state: ServerState, p: Prepared,
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
    sent = [_ChoiceStream(scanner=p.tools.scanner()) for _ in range(p.num_choices)]

    def event(choices: list[dict[str, Any]], usage: bool = False) -> bytes:
        payload = {"id": p.request_id, "object": obj, "created": p.created, "model": req.model,
                   "choices": choices}
        if usage:
            payload["usage"] = _usage(p, sum(c.tokens for c in sent))
        return _sse(payload)

    def chunk(index: int, delta: str | None, finish_reason: str | None,
              logprobs: Any = None, role: bool = False, call: dict | None = None,
              stop_reason: str | int | None = None) -> bytes:
        if chat:
            content: dict[str, Any] = {"role": "assistant"} if role else {}
            if delta is not None:
                content["content"] = delta
            if call is not None:
                content["tool_calls"] = [call]
            choice = {"index": index, "delta": content, "logprobs": logprobs,
                      "finish_reason": finish_reason, "stop_reason": stop_reason}
        else:
            choice = {"index": index, "text": delta or "", "logprobs": logprobs,
                      "finish_reason": finish_reason, "stop_reason": stop_reason}
        return event([choice], usage=req.continuous_usage)

    try:
        if chat:
            for index in range(p.num_choices):
                await response.write(chunk(index, "", None, role=True))
        async for index, output in outputs:
            choice = sent[index]
            choice.tokens = 0 if req.echo_only else len(output.token_ids)
            p.progress([c.tokens for c in sent])
            if output.finished and output.finish_reason == "error":
                await _end_with_error(state, response, 500, _failed_message(output),
                                      "request_error")
                return response
            delta = ""
            if req.echo_only:
                pass  # the prompt alone is the answer
            elif output.text.startswith(choice.text):  # text already sent is never retracted
                delta, choice.text = output.text[len(choice.text):], output.text
            echo = p.echo(index)
            if not choice.started and echo is not None:
                delta = echo + delta
            logprobs = None
            if output.logprobs is not None and len(output.logprobs) > choice.logprobs:
                if chat:
                    logprobs = chat_logprobs(zip(output.token_ids[choice.logprobs:],
                                                 output.logprobs[choice.logprobs:], strict=True),
                                             _token_text(state, req))
                else:
                    logprobs, choice.offset = _completion_logprobs(
                        state, p, index, output, choice.logprobs, choice.offset)
                choice.logprobs = len(output.logprobs)
            choice.started = True
            if choice.scanner is None:
                if delta or logprobs is not None:
                    await response.write(chunk(index, delta, None, logprobs))
            else:
                for piece in choice.scanner.feed(choice.text, output.finished):
                    if isinstance(piece, str):
                        await response.write(chunk(index, piece, None, logprobs))
                        logprobs = None
                        continue
                    call = _call_delta(piece, choice.scanner.index_of(piece))
                    await response.write(chunk(index, None, None, call=call))
                if logprobs is not None:
                    await response.write(chunk(index, "", None, logprobs))
            if output.finished:
                reason = _finish_reason(output.finish_reason, choice.scanner, p.tools)
                await response.write(chunk(index, None if chat else "", reason,
                                           stop_reason=output.stop_reason))
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


def _call_delta(piece: ToolCall | ArgumentsDelta, index: int | None) -> dict[str, Any]:
    """OpenAI's delta of a call: its index, id and name first (``ToolCall``: named, no
    arguments yet), then its arguments as they are written."""
    if isinstance(piece, ArgumentsDelta):
        return {"index": piece.index, "function": {"arguments": piece.text}}
    return {"index": index, "id": piece.id, "type": "function",
            "function": {"name": piece.name, "arguments": ""}}


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
