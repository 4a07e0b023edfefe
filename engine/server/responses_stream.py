"""A Responses request's outputs as Server-Sent Events, as vLLM 0.32 sends them for a
model without Harmony (``SimpleStreamingEventProcessor``): ``event: TYPE`` then its
JSON, numbered by ``sequence_number``.

``response.created`` and ``response.in_progress``; then each output item opened
(``response.output_item.added``; a message's or a reasoning item's
``response.content_part.added``), written (``response.reasoning_text.delta``,
``response.output_text.delta``, ``response.function_call_arguments.delta``) and closed
(``...done``, ``response.content_part.done``, ``response.output_item.done``) as the
answer turns from reasoning (``--reasoning-parser``) to content to a call; then
``response.completed`` with the whole ``response`` (its ``status`` ``incomplete`` when
the cap cut it, as vLLM sends it) and its usage: the items the events built and the
usage ``responses_answer`` gives a whole answer, so the stream adds up to it. A failure
after the headers went out is an ``error`` event, as OpenAI's. A client that leaves is
aborted by the chat route's ``finally``, like any other stream.
"""

from __future__ import annotations

import contextlib
import json
import logging
from typing import Any

from aiohttp import web

from kvledger.engine.errors import EngineDeadError
from kvledger.engine.server.answer_stream import open_stream
from kvledger.engine.server.answers import Prepared, added_text, failed_message
from kvledger.engine.server.responses_answer import (
    call_item,
    finished_response,
    item_id,
    logprob_entries,
    message_item,
    reasoning_item,
    reasoning_part,
    response_object,
    text_part,
)
from kvledger.engine.server.state import ServerState
from kvledger.engine.server.stream_interval import Pacing, interval_of
from kvledger.engine.server.text_pieces import TextPieces
from kvledger.engine.server.tools.parsers import ArgumentsDelta, ToolCall

log = logging.getLogger(__name__)


class _Events:
    """The stream's events, numbered, and the output items opened and closed so far."""

    def __init__(self, response: web.StreamResponse) -> None:
        self.response = response
        self.sequence = 0
        self.output: list[dict[str, Any]] = []  # closed items, in order
        self.open: dict[str, Any] | None = None  # the item being written
        self.text = TextPieces()  # the open item's text
        self.logprobs: list[dict[str, Any]] | None = None
        self.call: ToolCall | None = None

    async def send(self, kind: str, **fields: Any) -> None:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        await self.response.write(f"event: {kind}\ndata: ".encode()
                                  + json.dumps(payload, separators=(",", ":")).encode()
                                  + b"\n\n")

    @property
    def index(self) -> int:
        return len(self.output)

    async def content(self, delta: str, logprobs: list[dict[str, Any]] | None) -> None:
        if self.open is None or self.open["type"] != "message":
            await self.open_message(logprobs is not None)
        self.text.add(delta)
        if logprobs is not None and self.logprobs is not None:
            self.logprobs += logprobs
        await self.send("response.output_text.delta", output_index=self.index,
                        item_id=self.open["id"], content_index=0, delta=delta,
                        logprobs=logprobs or [])

    async def open_message(self, with_logprobs: bool) -> None:
        await self.close()
        self.open = message_item(item_id("msg"), "", None, "in_progress")
        self.text = TextPieces()
        self.logprobs = [] if with_logprobs else None
        await self.send("response.output_item.added", output_index=self.index, item=self.open)
        await self.send("response.content_part.added", output_index=self.index,
                        item_id=self.open["id"], content_index=0, part=text_part("", []))

    async def reasoning(self, delta: str) -> None:
        """A piece of reasoning: its item opened first, as vLLM opens it (no content yet,
        an empty ``reasoning_text`` part)."""
        if self.open is None or self.open["type"] != "reasoning":
            await self.close()
            self.open, self.text = reasoning_item(item_id("rs"), None, "in_progress"), \
                TextPieces()
            await self.send("response.output_item.added", output_index=self.index,
                            item=self.open)
            await self.send("response.content_part.added", output_index=self.index,
                            item_id=self.open["id"], content_index=0, part=reasoning_part(""))
        self.text.add(delta)
        await self.send("response.reasoning_text.delta", output_index=self.index,
                        item_id=self.open["id"], content_index=0, delta=delta)

    async def call_opened(self, call: ToolCall) -> None:
        await self.close()
        self.call, self.open = call, call_item(item_id("fc"), call, "in_progress")
        await self.send("response.output_item.added", output_index=self.index, item=self.open)

    async def arguments(self, delta: str) -> None:
        await self.send("response.function_call_arguments.delta", output_index=self.index,
                        item_id=self.open["id"], delta=delta)

    async def close(self) -> None:
        """The open item's closing events; it joins ``output``."""
        item, text = self.open, self.text.text()
        if item is None:
            return
        if item["type"] == "message":
            part = text_part(text, self.logprobs)
            await self.send("response.output_text.done", output_index=self.index,
                            item_id=item["id"], content_index=0, text=text, logprobs=[])
            await self.send("response.content_part.done", output_index=self.index,
                            item_id=item["id"], content_index=0, part=part)
            item = message_item(item["id"], text, self.logprobs)
        elif item["type"] == "reasoning":
            await self.send("response.reasoning_text.done", output_index=self.index,
                            item_id=item["id"], content_index=0, text=text)
            await self.send("response.content_part.done", output_index=self.index,
                            item_id=item["id"], content_index=0, part=reasoning_part(text))
            item = reasoning_item(item["id"], text)
        else:
            item = call_item(item["id"], self.call)
            await self.send("response.function_call_arguments.done", output_index=self.index,
                            item_id=item["id"], name=item["name"], arguments=item["arguments"])
        await self.send("response.output_item.done", output_index=self.index, item=item)
        self.output.append(item)
        self.open = None


async def stream(request: web.Request, state: ServerState, p: Prepared,
                 outputs) -> web.StreamResponse:
    response, opened = await open_stream(request)
    if not opened:
        return response
    events = _Events(response)
    scanner = p.tools.scanner()
    # --reasoning-parser: the reasoning is its own item, first; the content after it is
    # the message's text and its calls
    splitter = None if p.reasoning is None else p.reasoning.splitter()
    sent_text, sent_logprobs = "", 0
    with_logprobs = p.req.logprobs_k() is not None and p.shows_logprobs
    pending: list[dict[str, Any]] = []  # logprobs of tokens whose text is not out yet
    pacing = Pacing(interval_of(state, p.req))  # --stream-interval
    try:
        started = response_object(p, "in_progress", [], None)
        await events.send("response.created", response=started)
        await events.send("response.in_progress", response=started)
        final = None
        async for _, output in outputs:
            p.progress([len(output.token_ids)])
            if output.finished and output.finish_reason == "error":
                await _fail(state, events, failed_message(output), "request_error")
                return response
            if not pacing.due(len(output.token_ids), output.finished):
                continue  # the next output that goes out carries this one's text too
            if with_logprobs and output.logprobs is not None:  # held until text goes out
                pending += logprob_entries(state, p, output.token_ids[sent_logprobs:],
                                           output.logprobs[sent_logprobs:])
                sent_logprobs = len(output.logprobs)
            delta = ""
            if (added := added_text(sent_text, output.text)) is not None:
                delta, sent_text = added, output.text  # text sent is never retracted
            content_text = sent_text
            if splitter is not None:  # the step's reasoning first, then its content (vLLM's)
                thought, delta = splitter.feed(output.text, output.token_ids, output.finished)
                content_text = splitter.content if scanner is not None else ""
                if thought and p.reasoning.include:
                    await events.reasoning(thought)
            pieces = [delta] if scanner is None else scanner.feed(content_text,
                                                                  output.finished)
            for piece in pieces:
                if isinstance(piece, ToolCall):
                    await events.call_opened(piece)
                elif isinstance(piece, ArgumentsDelta):
                    await events.arguments(piece.text)
                elif piece:
                    await events.content(piece, pending if with_logprobs else None)
                    pending = []
            if output.finished:
                final = output
        if not events.output and events.open is None:  # no text, no call: an empty message
            await events.open_message(with_logprobs)
        if pending and events.logprobs is not None and events.open is not None:
            events.logprobs += pending  # tokens that wrote no text: in the item's list
        await events.close()
        body = finished_response(p, final, events.output, splitter)
        await events.send("response.completed", response=body)
    except ConnectionError:  # the client went away; the route's aclose() aborts it
        pass
    except EngineDeadError as exc:
        await _fail(state, events, str(exc), "engine_dead")
    except Exception:  # a bug after the 200 went out: the stream's last event says so
        log.exception("unhandled error while streaming %s", p.request_id)
        await _fail(state, events, "internal server error", "internal_error")
    return response


async def _fail(state: ServerState, events: _Events, message: str, code: str) -> None:
    """OpenAI's ``error`` event, counted as the app's middleware counts a 5xx."""
    state.metrics.count_failure(code)
    with contextlib.suppress(ConnectionError):
        await events.send("error", code=code, message=message, param=None)
