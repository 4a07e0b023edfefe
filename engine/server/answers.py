"""A request's outputs as OpenAI's answer: ``whole`` waits for every choice and answers
once, in one JSON body; ``answer_stream.stream`` writes them as Server-Sent Events with
the same pieces (a choice's finish and stop reasons, its logprobs, the usage), built here.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from kvledger.engine.frontend.generation import Generation
from kvledger.engine.server.api_errors import ApiError
from kvledger.engine.server.logprobs import chat_logprobs, completion_logprobs
from kvledger.engine.server.metrics import RequestTimeline
from kvledger.engine.server.protocol import GenerationRequest
from kvledger.engine.server.reasoning import ReasoningPlan, ReasoningSplitter
from kvledger.engine.server.state import ServerState
from kvledger.engine.server.tools.calls import NO_TOOLS, ToolPlan
from kvledger.engine.server.tools.parsers import CallScanner

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
    reasoning: ReasoningPlan | None = None  # --reasoning-parser's split of a chat's answers

    @property
    def num_choices(self) -> int:
        return self.generation.num_choices

    def prompt_ids(self, index: int) -> list[int]:
        """The prompt choice ``index`` answers."""
        return self.generation.runs[index // self.req.n].prompt_ids

    def echo(self, index: int) -> str | None:
        return self.echoes[index // self.req.n] if self.echoes else None

    @property
    def shows_logprobs(self) -> bool:
        """Whether asked-for logprobs are sent: not beside ``include_reasoning: false``
        (vLLM drops them with the reasoning: their tokens would show it)."""
        return self.reasoning is None or self.reasoning.include

    def progress(self, counts: list[int]) -> None:
        """How far each choice has got (``counts``: its tokens), for the request's timeline
        and the line's estimates."""
        self.timeline.generated(sum(counts))
        self.generation.progress(counts)


def usage_of(p: Prepared, completion_tokens: int,
             completion_details: dict[str, int] | None = None) -> dict[str, Any]:
    """OpenAI's usage; ``completion_details``: vLLM's ``completion_tokens_details``
    (a reasoning parser's ``reasoning_tokens``)."""
    prompt_tokens = p.generation.prompt_tokens
    usage: dict[str, Any] = {"prompt_tokens": prompt_tokens,
                             "completion_tokens": completion_tokens,
                             "total_tokens": prompt_tokens + completion_tokens}
    if p.cached_tokens is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": p.cached_tokens}
    if completion_details is not None:
        usage["completion_tokens_details"] = completion_details
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
        raise ApiError(500, failed_message(failed), code="request_error",
                       reason="request_error")
    # Logprobs make answers of megabytes (a 990-token prompt's, 20 a position, 16 choices:
    # 9.7 MB): built off the loop then, as /health and every stream must still answer.
    heavy = p.req.logprobs_k() is not None or p.req.prompt_logprobs_k() is not None
    body = await state.off_loop(None if heavy else 0, _whole_body, state, p, finals, counts)
    return web.Response(body=body, content_type="application/json", charset="utf-8")


def _whole_body(state: ServerState, p: Prepared, finals: list, counts: list[int]) -> bytes:
    """The whole answer's JSON."""
    chat = p.req.kind == "chat"
    split = p.reasoning
    splitters = [None if split is None else split.splitter() for _ in finals]
    choices = [_chat_choice(state, p, i, f, splitters[i]) if chat
               else _completion_choice(state, p, i, f) for i, f in enumerate(finals)]
    details = None if split is None else split.usage_details(
        splitters, [f.token_ids for f in finals])
    answer = {"id": p.request_id, "object": "chat.completion" if chat else "text_completion",
              "created": p.created, "model": p.req.model, "choices": choices,
              "usage": usage_of(p, sum(counts), details)}
    if p.req.return_token_ids:  # vLLM's: the ids the answer came from (a chat's prompt's
        for index, choice in enumerate(choices):  # on the answer, a completion's each)
            choice["token_ids"] = [] if p.req.echo_only else finals[index].token_ids
            if not chat:
                choice["prompt_token_ids"] = p.prompt_ids(index)
        if chat:
            answer["prompt_token_ids"] = p.prompt_ids(0)
    # A choice at a time: json.dumps holds the GIL for its whole call (100 ms for a choice
    # of echoed logprobs), and the loop's thread needs it between them.
    head = {k: answer.pop(k) for k in ("id", "object", "created", "model")}
    encoded = b",".join(json.dumps(choice).encode() for choice in answer.pop("choices"))
    return (json.dumps(head)[:-1].encode() + b', "choices": [' + encoded + b"], "
            + json.dumps(answer)[1:].encode())


def _chat_choice(state: ServerState, p: Prepared, index: int, final,
                 splitter: ReasoningSplitter | None) -> dict[str, Any]:
    logprobs = None
    if final.logprobs is not None and p.shows_logprobs:
        logprobs = chat_logprobs(zip(final.token_ids, final.logprobs, strict=True),
                                 token_text(state, p.req))
    text = final.text
    message: dict[str, Any] = {"role": p.req.answer_role(state.options.response_role),
                               "content": text}
    if splitter is not None:  # vLLM's reasoning field, then the content after it
        splitter.feed(final.text, final.token_ids, final=True)
        text = splitter.content
        message["content"] = text or None
        message["reasoning"] = (splitter.reasoning or None) if p.reasoning.include else None
    scanner = p.tools.scanner()
    if scanner is not None:  # the same reading a stream makes, all at once
        scanner.feed(text, final=True)
        empty = None if scanner.calls or splitter is not None else ""
        message["content"] = scanner.content or empty
        if scanner.calls:
            message["tool_calls"] = [call.as_openai() for call in scanner.calls]
    return {"index": index, "message": message, "logprobs": logprobs,
            "finish_reason": choice_finish_reason(final.finish_reason, scanner, p.tools),
            "stop_reason": final.stop_reason}


def choice_finish_reason(reason: str | None, scanner: CallScanner | None,
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
            "logprobs": completion_logprobs_of(state, p, index, final, 0, 0)[0],
            "finish_reason": final.finish_reason, "stop_reason": final.stop_reason}


def completion_logprobs_of(state: ServerState, p: Prepared, index: int, output, sent: int,
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
    logprobs = completion_logprobs(entries, token_text(state, p.req), offset)
    if logprobs["tokens"]:
        offset = logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])
    return logprobs, offset


# The characters before the seam that a step's check compares (``added_text``).
_SEAM_CHARS = 64


def added_text(sent: str, text: str) -> str | None:
    """What ``text`` (a choice's text so far) adds after ``sent`` (its text at the last
    step, all sent), or None when it does not go on from it. The engine's text only grows
    (a stop string's possible start is held back until it is known: ``request_output``),
    so this checks the seam, the last characters sent, not all of them: a step costs what
    it adds, however long the answer."""
    at = len(sent)
    if len(text) < at or text[max(0, at - _SEAM_CHARS):at] != sent[-_SEAM_CHARS:]:
        return None
    return text[at:]


def token_text(state: ServerState, req: GenerationRequest):
    """How logprobs name a token: its text, or vLLM's ``token_id:N`` when asked."""
    return (_token_id_text if req.return_tokens_as_token_ids
            or state.options.return_tokens_as_token_ids else state.token_text)


def _token_id_text(token_id: int) -> str:
    return f"token_id:{token_id}"


def failed_message(output) -> str:
    return f"the engine failed this request ({output.error}); other requests are unaffected"
