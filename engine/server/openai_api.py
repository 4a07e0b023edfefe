"""``POST /v1/completions`` and ``POST /v1/chat/completions``: HTTP around the engine's
front door.

One request's story here: read -> parse -> its model, tools and chat template -> a typed
``Submission`` -> ``FrontDoor.submit`` (which checks it, tokenizes, caps and admits it, or
refuses with the engine's errors, mapped by ``api_errors.engine_error`` to 400/404/429/503)
-> answer (JSON or SSE, ``answers.py``). Parsing and rendering the chat template run on
the server's worker threads, so a 4 MiB body never stalls the event loop; nothing is
reserved until the door admits it, so a client that leaves meanwhile holds no blocks.
``Generation.aclose`` in ``finally`` ends it whatever happens: unfinished choices
aborted, every reservation back.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid

from aiohttp import web

from kvledger.engine.errors import BadConstraint, EngineDeadError, KVCacheFull
from kvledger.engine.frontend.door import FrontDoor
from kvledger.engine.frontend.generation import Generation
from kvledger.engine.frontend.submission import Submission, Tenant
from kvledger.engine.server import answer_stream, answers
from kvledger.engine.server.api_errors import ApiError, admission_error, bad_request, engine_error
from kvledger.engine.server.limits import CLIENT_ID_PATTERN, MAX_CLIENT_ID_CHARS, decode_json
from kvledger.engine.server.protocol import (
    GenerationRequest,
    parse_chat,
    parse_completion,
)
from kvledger.engine.server.reasoning_request import reasoning_plan
from kvledger.engine.server.request_fields import (
    chat_prompt,
    check_logprobs,
    render_size,
    sampling_params,
)
from kvledger.engine.server.state import API_KEY_INDEX, STATE, ServerState
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
    return await serve(request, parse_completion, "cmpl-", usage_forceable=True)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await serve(request, parse_chat, "chatcmpl-", usage_forceable=True)


async def serve(request: web.Request, parse, id_prefix: str, whole=answers.whole,
                stream=answer_stream.stream, usage_forceable: bool = False) -> web.StreamResponse:
    """One generation request's whole story (the module's docstring): ``parse`` reads the
    body as a completion's or a chat's request; ``whole`` and ``stream`` write its answer
    (another API's shape, for a request translated into a chat's: ``responses_api``).
    ``usage_forceable``: ``--enable-force-include-usage`` applies (completions and chat,
    as vLLM's; a Responses stream always ends with its usage)."""
    arrived = time.monotonic()
    state = request.app[STATE]
    door = state.check_accepting()
    timeline = state.metrics.timeline(arrived)
    client_id = _client_request_id(request)
    raw = await read_body(request)
    req = await state.off_loop(len(raw), _parse, parse, raw)
    if usage_forceable and state.options.enable_force_include_usage:
        req.force_usage()
    lora = state.check_model(req.model)  # a LoRA adapter's request, or None: the base model
    # Answers carry the adapter's name, else the first served name, as vLLM's do.
    req.model = state.model_name if lora is None else lora.lora_name
    check_logprobs(state, req)
    tools = _tool_plan(state, req)
    reasoning = reasoning_plan(state, req)
    prompts = [await state.off_loop(render_size(len(raw), req), chat_prompt, state, req)] \
        if req.kind == "chat" else req.prompt
    tenant = state.tenant(request)
    timeline.tenant = tenant.label
    spec = ("lark", tools.grammar) if tools.grammar is not None else req.grammar()
    sub = Submission(f"{id_prefix}{uuid.uuid4().hex}", prompts,
                     sampling_params(req, door.sampling_defaults, tools.kept_ids | (
                         frozenset() if reasoning is None else reasoning.tokens.kept_ids)),
                     req.n, spec, lora, tenant, req.priority, _client_salt(request, state, req),
                     grammar_gate=None if reasoning is None else reasoning.grammar_gate(),
                     objective_priority=state.objective(request, tenant),
                     add_special_tokens=req.special_tokens_added, body_bytes=len(raw),
                     published_salt=req.cache_salt, default_cap=req.default_cap)
    generation = await _submit(state, door, sub, req, tools)
    if reasoning is not None:  # a chat: one prompt, whose end may end the reasoning
        reasoning = reasoning.after_prompt(generation.runs[0].prompt_ids)
    client_id = client_id or req.request_id  # the header's, as vLLM's, else the body's
    answer_id = sub.request_id if client_id is None else f"{id_prefix}{client_id}"
    p = answers.Prepared(req, answer_id, generation, timeline, int(time.time()), tools,
                         [_echo(door, req, prompt, run.prompt_ids)
                          for prompt, run in zip(prompts, generation.runs, strict=True)],
                         reasoning=reasoning)
    try:
        _admitted(state, p, lora)
        if req.stream:
            return await stream(request, state, p, generation)
        return await whole(state, p, generation)
    except EngineDeadError as exc:
        raise engine_error(exc) from None
    finally:
        await generation.aclose()
        timeline.finished(generation.finish_reasons, generation.choice_tokens, generation.n)


async def _submit(state: ServerState, door: FrontDoor, sub: Submission,
                  req: GenerationRequest, tools: ToolPlan) -> Generation:
    """The door's ``Generation`` for ``sub``; its refusals as HTTP errors (a 429 counted
    for the request's tenant too; a constraint named by the field that carried it)."""
    try:
        return await door.submit(sub)
    except KVCacheFull as exc:
        raise busy(state, sub.tenant, exc) from None
    except BadConstraint as exc:
        raise await _constraint_error(state, req, tools, exc) from None
    except Exception as exc:
        raise engine_error(exc) or exc from None


def busy(state: ServerState, tenant: Tenant, exc: KVCacheFull) -> ApiError:
    """The 429 of a refusal (``admission_error``), counted for ``tenant`` too."""
    state.metrics.count_tenant_rejection(tenant.label, exc.reason)
    return admission_error(exc)


def _client_request_id(request: web.Request) -> str | None:
    """The client's ``X-Request-Id``, which names the answer (``cmpl-ID``) as vLLM's does
    (before the body's ``request_id``); None without one. The engine keys the request by an id of its own all the same, so two
    clients sending one id never meet. A 400 for one that is not 1-256 visible ASCII
    characters."""
    value = request.headers.get("X-Request-Id")
    if value is None:
        return None
    if re.fullmatch(CLIENT_ID_PATTERN, value) is None:  # the body's request_id's rule
        raise ApiError(400, f"X-Request-Id must be 1-{MAX_CLIENT_ID_CHARS} visible ASCII "
                            "characters", code="invalid_request", reason="bad_request")
    return value


def _client_salt(request: web.Request, state: ServerState, req: GenerationRequest) -> str | None:
    """What keys this request's prefix-cache blocks apart, beside its adapter (the door
    adds the adapter's): its ``cache_salt``, under its API key's own with
    ``--cache-salt-per-key`` (so requests under different keys never share a block,
    whatever salts their clients send); None: the shared cache."""
    parts = []
    if state.options.salt_cache_per_key and API_KEY_INDEX in request:
        parts.append(f"key:{request[API_KEY_INDEX]}")
    if req.cache_salt is not None:
        parts.append("salt:" + req.cache_salt)
    return "\0".join(parts) or None


def _echo(door: FrontDoor, req: GenerationRequest, prompt: str | list[int],
          prompt_ids: list[int]) -> str | None:
    """Completions' ``echo``: the prompt's text before the answer's; else None."""
    if req.kind != "completion" or not req.echo:
        return None
    return prompt if isinstance(prompt, str) else door.tokenizer.decode(prompt_ids)


def _admitted(state: ServerState, p: answers.Prepared, lora) -> None:
    """What follows a request's admission (every prompt's): its timeline and adapter
    counted, its cached prompt tokens (--enable-prompt-tokens-details) and its log line
    (--enable-log-requests)."""
    generation = p.generation
    p.timeline.admitted(generation.prompt_tokens)
    if state.options.prompt_tokens_details:
        p.cached_tokens = generation.cached_tokens
    if state.options.log_requests:  # ids, sizes and parameters; never the prompt's text
        params = generation.runs[0].choices[0].params
        log.info("request %s: %d prompt tokens (%d prompts), max_tokens %s, n %d, model %r, "
                 "%s", p.request_id, generation.prompt_tokens, len(generation.runs),
                 "/".join(str(run.cap_tokens) for run in generation.runs), p.req.n,
                 p.req.model, params.summary())
    if lora is not None:
        state.served.count_adapter_request(lora.lora_name)


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


def _tool_plan(state: ServerState, req: GenerationRequest) -> ToolPlan:
    """How a chat's ``tools`` are served (``calls``); completions have none."""
    if req.kind != "chat" or not req.tools:
        return NO_TOOLS
    try:
        return tool_plan(req.tools, req.tool_choice, req.parallel_tool_calls,
                         auto_enabled=state.options.enable_auto_tool_choice,
                         parser=state.options.tool_call_parser,
                         chat_template=state.door.tokenizer.chat_template,
                         specials=control_token_ids(state.door.tokenizer),
                         template_kwargs=req.template_kwargs(
                             state.options.default_chat_template_kwargs))
    except Refusal as exc:
        raise bad_request(exc.message, exc.param) from None


async def _constraint_error(state: ServerState, req: GenerationRequest, tools: ToolPlan,
                            exc: BadConstraint) -> ApiError:
    """A refused output constraint as a 400 naming the field that carried it; for a
    tool-call grammar, the function whose schema was refused when one was."""
    if tools.grammar is None:
        return bad_request(str(exc), constraint_field(req))
    problem = None  # (one over the limits is not re-run)
    if not exc.costly:
        problem = await state.off_loop(None, schema_problem, req.tools)
    return bad_request(problem or f"the tool-call grammar of 'tools': {exc}", "tools")
