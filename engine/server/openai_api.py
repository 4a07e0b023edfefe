"""``POST /v1/completions`` and ``POST /v1/chat/completions``.

One request's story: read -> parse -> tokenize -> effective cap -> reserve (or 429) ->
generate -> answer (JSON or SSE, ``answers.py``). Admission (``kvledger.engine.admission``)
refuses with the engine's errors, which ``api_errors.admission_error`` maps to 400/429. Parsing, rendering the chat template and
tokenizing run on the server's worker threads, so a 4 MiB body never stalls the event
loop; nothing is reserved until they are done, so a client that leaves meanwhile holds no
blocks. Each of the engine's rules runs once, before admission (prompt ids, cap, params);
the engine takes the ``EngineRequest`` as it is. Each reservation goes to the engine with
its ``generate`` call; closing the output stream in ``finally`` aborts an unfinished
request (client gone, shutdown, error), and the engine then returns its blocks;
``Admission.give_back`` returns those never handed over.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from aiohttp import web

from kvledger.engine.core.async_engine import EngineDeadError
from kvledger.engine.core.request import EngineRequest
from kvledger.engine.errors import BadInput, CapTooLarge, PromptTooLong
from kvledger.engine.server import answers
from kvledger.engine.server.admit import AdmitAs, admit, busy, cache_salt, request_priority
from kvledger.engine.server.api_errors import ApiError, admission_error, bad_request
from kvledger.engine.server.limits import decode_json
from kvledger.engine.server.protocol import (
    GenerationRequest,
    parse_chat,
    parse_completion,
)
from kvledger.engine.server.request_fields import (
    chat_prompt,
    check_logprobs,
    default_cap,
    sampling_params,
)
from kvledger.engine.server.state import STATE, ServerState
from kvledger.engine.server.structured_outputs import constraint_field
from kvledger.engine.server.tools.calls import (
    NO_TOOLS,
    ToolPlan,
    control_token_ids,
    schema_problem,
    tool_plan,
)
from kvledger.engine.server.validation import Refusal

log = logging.getLogger(__name__)


async def completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, parse_completion, "cmpl")


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, parse_chat, "chatcmpl")


async def _serve(request: web.Request, parse, id_prefix: str) -> web.StreamResponse:
    arrived = time.monotonic()
    state = request.app[STATE]
    state.check_accepting()
    timeline = state.metrics.timeline(arrived)
    raw = await read_body(request)
    req = await state.off_loop(len(raw), _parse, parse, raw)
    lora = state.check_model(req.model)  # a LoRA adapter's request, or None: the base model
    # Answers carry the adapter's name, else the first served name, as vLLM's do.
    req.model = state.model_name if lora is None else lora.lora_name
    check_logprobs(state, req)
    tools = _tool_plan(state, req)
    prompts = [await state.off_loop(len(raw), chat_prompt, state, req)] \
        if req.kind == "chat" else req.prompt
    defaults = state.engine.tokenizer.sampling_defaults  # the model's (--generation-config)
    tenant = state.tenant(request)
    timeline.tenant = tenant.label
    priority = request_priority(state, req, tenant)
    longest = max(_max_prompt_tokens(prompt) for prompt in prompts)
    early = state.admission.early_rejection(longest, req.cap, req.n, tenant, priority)
    if early is not None:  # a full pool refuses it whatever its exact length
        raise busy(state, tenant, early)
    ids = await state.off_loop(len(raw), _encode_all, state, req, prompts)
    caps = [_cap(state, req, len(prompt_ids), defaults) for prompt_ids in ids]
    for prompt, prompt_ids in zip(prompts, ids, strict=True):
        if not isinstance(prompt, list):  # the tokenizer's ids, checked once they fit
            _check_prompt(state, prompt_ids)
    grammar = await _grammar(state, req, tools)
    # Choice k answers prompt k // n with its cap; its seed is offset by k % n, so a prompt
    # draws the same tokens in a batch as alone (each prompt is its own request in vLLM).
    params = [sampling_params(req, caps[k // req.n], grammar, k % req.n, defaults,
                              tools.kept_ids) for k in range(len(prompts) * req.n)]
    try:  # before admission: token ids the model lacks (logit_bias) are a 400
        state.engine.check_params(params[0])  # the choices differ in their seeds and caps
    except BadInput as exc:
        raise bad_request(str(exc), "logit_bias") from None
    adapter = None if lora is None else await _adapter(state, lora)
    parts = [answers.Part(prompt_ids, [EngineRequest(prompt_ids, params[i * req.n + j], cap,
                                                     adapter, priority, tenant)
                                       for j in range(req.n)],
                          _echo(state, req, prompt, prompt_ids))  # the engine's rules met
             for i, (prompt, prompt_ids, cap) in enumerate(zip(prompts, ids, caps, strict=True))]
    p = answers.Prepared(req, f"{id_prefix}-{uuid.uuid4().hex}", parts, timeline,
                         int(time.time()), tools)
    salt = cache_salt(request, state, req, parts[0].choices[0].lora_salt)
    return await _answer(request, state, p, AdmitAs(salt, tenant, priority), lora)


def _cap(state: ServerState, req: GenerationRequest, prompt_tokens: int, defaults) -> int:
    """A prompt's output cap (``Admission.effective_cap``, the model's default
    ``max_tokens`` when the request sets none); its refusals as 400s."""
    try:
        return default_cap(state.admission.effective_cap(prompt_tokens, req.cap), req.cap,
                           defaults)
    except (PromptTooLong, CapTooLarge) as exc:
        raise admission_error(exc) from None


def _echo(state: ServerState, req: GenerationRequest, prompt: str | list[int],
          prompt_ids: list[int]) -> str | None:
    """Completions' ``echo``: the prompt's text before the answer's; else None."""
    if req.kind != "completion" or not req.echo:
        return None
    return prompt if isinstance(prompt, str) else state.engine.tokenizer.decode(prompt_ids)


def _admitted(state: ServerState, p: answers.Prepared, lora) -> None:
    """What follows a request's admission (every prompt's): its timeline and adapter
    counted, its cached prompt tokens (--enable-prompt-tokens-details) and its log line
    (--enable-log-requests)."""
    p.timeline.admitted(p.prompt_tokens)
    if state.options.prompt_tokens_details:
        block_size = state.engine.ledger.block_size
        p.cached_tokens = sum(min(part.ticket.reservations[0].num_cached_blocks * block_size,
                                  len(part.prompt_ids)) for part in p.parts)
    if state.options.log_requests:  # ids, sizes and parameters; never the prompt's text
        params = p.parts[0].choices[0].params
        log.info("request %s: %d prompt tokens (%d prompts), max_tokens %s, n %d, model %r, "
                 "%s", p.request_id, p.prompt_tokens, len(p.parts),
                 "/".join(str(part.choices[0].cap_tokens) for part in p.parts), p.req.n,
                 p.req.model, params.summary())
    if lora is not None:
        state.engine.loras.count(lora.lora_name)


async def _answer(request: web.Request, state: ServerState, p: answers.Prepared,
                  how: AdmitAs, lora) -> web.StreamResponse:
    """Each prompt admitted in turn and its choices handed to the engine at once (so a
    batch never holds blocks idle while a later prompt waits in line; a refusal of one
    aborts those started and answers the request's 429), then the answer sent whole or
    streamed; whatever happens, every reservation goes back and, once every prompt was
    admitted, the request's end is measured."""
    streams: list = []
    admitted = False
    try:
        for i, part in enumerate(p.parts):  # admission keys each prompt's ticket apart
            ticket_id = p.request_id if len(p.parts) == 1 else f"{p.request_id}-prompt{i}"
            part.ticket = await admit(state, ticket_id, part.choices, how)
            for j, reservation in enumerate(part.ticket.reservations):
                choice_id = p.request_id if p.num_choices == 1 \
                    else f"{p.request_id}-{len(streams)}"
                part.handed = j + 1  # from this call on the engine owns it, even if it refuses it
                streams.append(state.async_engine.generate(choice_id, part.choices[j],
                                                           reservation=reservation))
        admitted = True
        _admitted(state, p, lora)
        async with aclosing(_merged(streams)) as outputs:
            if p.req.stream:
                return await answers.stream(request, state, p, outputs)
            return await answers.whole(state, p, outputs)
    except EngineDeadError as exc:
        raise ApiError(503, str(exc), code="engine_dead", reason="engine_dead") from None
    except BadInput as exc:
        raise bad_request(str(exc)) from None
    finally:
        # The engine releases what it was handed (closing a stream aborts it); the rest
        # never left admission.
        for part in p.parts:
            if part.ticket is not None:
                state.admission.give_back(part.ticket.reservations[part.handed:])
        reasons, generated = [], 0
        for stream in streams:
            await stream.aclose()
            last = stream.last
            reasons.append(last.finish_reason if last is not None and last.finished
                           else "abort")
            generated += len(last.token_ids) if last else 0
        for part in p.parts:
            if part.ticket is not None:
                state.admission.done(part.ticket)
        if admitted:
            p.timeline.finished(reasons, generated)


async def _adapter(state: ServerState, lora) -> Any:
    """The loaded adapter (read from disk again, off the loop, if the host cache let it go)."""
    try:
        return await state.load_adapter(state.engine.resolve_lora, lora)
    except BadInput as exc:
        raise bad_request(str(exc), "model") from None


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
# request which deserved a 400 gets a 429 first, and its retry the 400.
_ADDED_TOKENS_MAX = 8


def _max_prompt_tokens(prompt: str | list[int]) -> int:
    if isinstance(prompt, list):
        return len(prompt)
    return len(prompt.encode()) + _ADDED_TOKENS_MAX


def _encode_all(state: ServerState, req: GenerationRequest,
                prompts: list[str | list[int]]) -> list[list[int]]:
    return [_encode(state, req, prompt) for prompt in prompts]


def _encode(state: ServerState, req: GenerationRequest, prompt: str | list[int]) -> list[int]:
    if isinstance(prompt, list):
        _check_prompt(state, prompt)  # the client's ids: before anything else looks at them
        return prompt
    # A rendered chat template already holds its special tokens (BOS included).
    ids = state.engine.tokenizer.encode(prompt, add_special_tokens=req.kind != "chat")
    if not ids:
        raise bad_request("the prompt encodes to zero tokens", "prompt")
    return ids


def _check_prompt(state: ServerState, prompt_ids: list[int]) -> None:
    """The engine's prompt rule, once per request and before admission: a request the
    model cannot run is never counted admitted."""
    try:
        state.engine.check_prompt(prompt_ids)
    except BadInput as exc:
        raise bad_request(str(exc), "prompt") from None


def _tool_plan(state: ServerState, req: GenerationRequest) -> ToolPlan:
    """How a chat's ``tools`` are served (``calls``); completions have none."""
    if req.kind != "chat" or not req.tools:
        return NO_TOOLS
    try:
        return tool_plan(req.tools, req.tool_choice, req.parallel_tool_calls,
                         auto_enabled=state.options.enable_auto_tool_choice,
                         parser=state.options.tool_call_parser,
                         chat_template=state.engine.tokenizer.chat_template,
                         specials=control_token_ids(state.engine.tokenizer))
    except Refusal as exc:
        raise bad_request(exc.message, exc.param) from None


async def _grammar(state: ServerState, req: GenerationRequest, tools: ToolPlan) -> Any:
    """The compiled output constraint, or None: from the cache at once, else compiled on
    the compiler's own threads (a heavy schema takes seconds there, never a thread or a
    lock another request waits on) within ``--grammar-compile-timeout``, else a 400."""
    spec = ("lark", tools.grammar) if tools.grammar is not None else req.grammar()
    if spec is None:
        return None
    from kvledger.engine.sampling.grammar import (
        GrammarError,
        GrammarSpec,
        GrammarTooCostly,
        compile_timeout_error,
    )

    compiler, spec = state.grammars, GrammarSpec(*spec)
    try:
        grammar = compiler.lookup(spec)
        if grammar is not None:
            return grammar
        future = compiler.submit(spec)
        timeout_s = state.options.grammar_compile_timeout_s
        try:  # shielded: a timeout must not cancel a compile other requests wait for
            return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), timeout_s)
        except TimeoutError:
            compiler.abandon(spec, future)
            raise compile_timeout_error(spec, timeout_s) from None
        except asyncio.CancelledError:
            compiler.abandon(spec, future)
            raise
    except GrammarError as exc:
        if tools.grammar is None:
            raise bad_request(str(exc), constraint_field(req)) from None
        problem = None  # else name the function whose schema was refused, if one was
        if not isinstance(exc, GrammarTooCostly):  # (one over the limits is not re-run)
            problem = await state.off_loop(None, schema_problem, req.tools)
        raise bad_request(problem or f"the tool-call grammar of 'tools': {exc}", "tools") from None
