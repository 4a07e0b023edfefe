"""A request's outputs as Server-Sent Events: each choice's new text (its logprobs, its
tool calls as they are written) as the engine produces it, then the usage and ``[DONE]``.
A failure after the headers went out ends the stream with an error event and ``[DONE]``,
so clients' stream readers end normally. The pieces of a choice are ``answers``'.
"""

from __future__ import annotations

import contextlib
import json
import logging
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from kvledger.engine.errors import EngineDeadError
from kvledger.engine.server.answers import (
    Prepared,
    added_text,
    choice_finish_reason,
    completion_logprobs_of,
    failed_message,
    token_text,
    usage_of,
)
from kvledger.engine.server.api_errors import sse_error_event
from kvledger.engine.server.keep_alive import kept_alive
from kvledger.engine.server.logprobs import chat_logprobs
from kvledger.engine.server.reasoning import ReasoningSplitter
from kvledger.engine.server.state import ServerState
from kvledger.engine.server.stream_interval import Pacing, interval_of
from kvledger.engine.server.tools.parsers import ArgumentsDelta, CallScanner, ToolCall

log = logging.getLogger(__name__)


@dataclass
class _ChoiceStream:
    """What one choice of a stream has sent so far."""

    text: str = ""
    tokens: int = 0
    logprobs: int = 0
    offset: int = 0  # where the next logprob's token starts in the text sent (text_offset)
    started: bool = False
    ids_seen: int = 0  # return_token_ids: the output's ids read so far,
    ids: list[int] = field(default_factory=list)  # of which the next chunk's (unsent)
    prompt_sent: bool = False  # return_token_ids: its prompt's ids went out
    scanner: CallScanner | None = None  # a chat with tools: reads calls from the text
    splitter: ReasoningSplitter | None = None  # --reasoning-parser: reasoning, then content
    output_ids: list[int] = field(default_factory=list)  # its output's ids so far
    pacing: Pacing = field(default_factory=lambda: Pacing(1))  # --stream-interval


async def open_stream(request: web.Request) -> tuple[web.StreamResponse, bool]:
    """The event stream's response, and whether its headers went out: not when the client
    left before them (the route's ``aclose()`` of the generation then aborts the request)."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
    try:
        await response.prepare(request)
    except ConnectionError:
        return response, False
    return response, True


async def stream(request: web.Request, state: ServerState, p: Prepared,
                 outputs) -> web.StreamResponse:
    response, opened = await open_stream(request)
    if not opened:
        return response
    req = p.req
    chat = req.kind == "chat"
    obj = "chat.completion.chunk" if chat else "text_completion"
    split = p.reasoning
    interval = interval_of(state, req)
    sent = [_ChoiceStream(scanner=p.tools.scanner(),
                          splitter=None if split is None else split.splitter(),
                          pacing=Pacing(interval))
            for _ in range(p.num_choices)]

    def event(choices: list[dict[str, Any]], usage: bool = False,
              prompt_ids: list[int] | None = None) -> bytes:
        payload = {"id": p.request_id, "object": obj, "created": p.created, "model": req.model,
                   "choices": choices}
        if prompt_ids is not None:  # a chat's, with its first chunk (return_token_ids)
            payload["prompt_token_ids"] = prompt_ids
        if usage:
            details = None if split is None else split.usage_details(
                [c.splitter for c in sent], [c.output_ids for c in sent])
            payload["usage"] = usage_of(p, sum(c.tokens for c in sent), details)
        return _sse(payload)

    def chunk(index: int, delta: str | None, finish_reason: str | None,
              logprobs: Any = None, role: bool = False, call: dict | None = None,
              stop_reason: str | int | None = None, reasoning: str | None = None) -> bytes:
        if chat:
            content: dict[str, Any] = (
                {"role": req.answer_role(state.options.response_role)} if role else {})
            if reasoning is not None:  # vLLM's delta.reasoning
                content["reasoning"] = reasoning
            if delta is not None:
                content["content"] = delta
            if call is not None:
                content["tool_calls"] = [call]
            choice = {"index": index, "delta": content, "logprobs": logprobs,
                      "finish_reason": finish_reason, "stop_reason": stop_reason}
        else:
            choice = {"index": index, "text": delta or "", "logprobs": logprobs,
                      "finish_reason": finish_reason, "stop_reason": stop_reason}
        prompt_ids = None
        if req.return_token_ids:  # vLLM's: each chunk the ids its text came from
            sent_ids = sent[index]
            choice["token_ids"], sent_ids.ids = sent_ids.ids, []
            if not sent_ids.prompt_sent:
                sent_ids.prompt_sent, prompt_ids = True, p.prompt_ids(index)
                if not chat:
                    choice["prompt_token_ids"], prompt_ids = prompt_ids, None
        return event([choice], usage=req.continuous_usage, prompt_ids=prompt_ids)

    keep_alive = state.options.sse_keep_alive_interval_s
    items = kept_alive(outputs, keep_alive, response.write) if keep_alive > 0 else outputs
    try:
        if chat:
            for index in range(p.num_choices):
                await response.write(chunk(index, "", None, role=True))
        async for index, output in items:
            choice = sent[index]
            choice.tokens = 0 if req.echo_only else len(output.token_ids)
            p.progress([c.tokens for c in sent])
            if req.return_token_ids and not req.echo_only:
                choice.ids += output.token_ids[choice.ids_seen:]
                choice.ids_seen = len(output.token_ids)
            if output.finished and output.finish_reason == "error":
                await _end_with_error(state, response, 500, failed_message(output),
                                      "request_error")
                return response
            if not choice.pacing.due(len(output.token_ids), output.finished):
                continue  # the next output that goes out carries this one's text too
            delta = ""
            if req.echo_only:
                pass  # the prompt alone is the answer
            elif (added := added_text(choice.text, output.text)) is not None:
                delta, choice.text = added, output.text  # text sent is never retracted
            echo = p.echo(index)
            if not choice.started and echo is not None:
                delta = echo + delta
            logprobs = None
            if output.logprobs is not None and len(output.logprobs) > choice.logprobs:
                if chat:
                    logprobs = chat_logprobs(zip(output.token_ids[choice.logprobs:],
                                                 output.logprobs[choice.logprobs:], strict=True),
                                             token_text(state, req))
                else:
                    logprobs, choice.offset = completion_logprobs_of(
                        state, p, index, output, choice.logprobs, choice.offset)
                choice.logprobs = len(output.logprobs)
            choice.started = True
            content_text = choice.text
            if choice.splitter is not None:  # the reasoning first, then the content
                choice.output_ids = output.token_ids
                thought, delta = choice.splitter.feed(output.text, output.token_ids,
                                                      output.finished)
                content_text = choice.splitter.content if choice.scanner is not None else ""
                if not split.include:
                    thought = ""
                if not p.shows_logprobs:
                    logprobs = None
                if thought:
                    await response.write(chunk(index, None, None, logprobs, reasoning=thought))
                    logprobs = None
            if choice.scanner is None:
                if delta or logprobs is not None:
                    await response.write(chunk(index, delta, None, logprobs))
            else:
                for piece in choice.scanner.feed(content_text, output.finished):
                    if isinstance(piece, str):
                        await response.write(chunk(index, piece, None, logprobs))
                        logprobs = None
                        continue
                    call = _call_delta(piece, choice.scanner.index_of(piece))
                    await response.write(chunk(index, None, None, call=call))
                if logprobs is not None:
                    await response.write(chunk(index, "", None, logprobs))
            if output.finished:
                reason = choice_finish_reason(output.finish_reason, choice.scanner, p.tools)
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
    finally:
        if items is not outputs:  # its pending read ends before the generation closes
            await items.aclose()
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


def _sse(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"
