"""A request's place in admission's line, for the completions routes: the priority it
runs at (its tenant's limits, the scheduling policy), what keys its prefix-cache blocks
apart, admission's ticket for each of its prompts, and its refusals as HTTP errors, the
429s counted per tenant too."""

from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web

from kvledger.engine.admission.order import Tenant
from kvledger.engine.admission.ticket import Ticket
from kvledger.engine.core.request import EngineRequest
from kvledger.engine.errors import BadInput, KVCacheFull, PoolTooSmall
from kvledger.engine.server.api_errors import ApiError, admission_error, bad_request
from kvledger.engine.server.protocol import GenerationRequest
from kvledger.engine.server.state import API_KEY_INDEX, ServerState


@dataclass(frozen=True)
class AdmitAs:
    """How a request's prompts line up: their prefix-cache salt, tenant and priority."""

    salt: str | None
    tenant: Tenant
    priority: int


def request_priority(state: ServerState, req: GenerationRequest, tenant: Tenant) -> int:
    """The priority the request runs at. vLLM's ``priority`` orders the line under
    ``--scheduling-policy priority`` only; under fcfs a non-zero one is a 400, as vLLM
    documents, never silently dropped. Under priority: the one asked (its tenant's
    default when none), a 400 when more urgent than its tenant may ask."""
    if state.admission.scheduling_policy != "priority":
        if req.priority:
            raise bad_request(f"priority {req.priority} needs --scheduling-policy priority "
                              f"(this server's is {state.admission.scheduling_policy})",
                              "priority")
        return 0
    try:
        return state.tenants.priority(tenant, req.priority)
    except BadInput as exc:
        raise bad_request(str(exc), "priority") from None


def busy(state: ServerState, tenant: Tenant, exc: KVCacheFull) -> ApiError:
    """The 429 of a refusal (``admission_error``), counted for ``tenant`` too."""
    state.metrics.count_tenant_rejection(tenant.label, exc.reason)
    return admission_error(exc)


async def admit(state: ServerState, request_id: str, choices: list[EngineRequest],
                how: AdmitAs) -> Ticket:
    """Admission's ticket for the ``choices`` of one prompt (each ``prompt + cap``, keyed
    with the salt in the prefix cache, placed in line by tenant and priority); its
    refusals as HTTP errors (400, 429)."""
    first = choices[0]
    try:
        return await state.admission.admit(request_id, len(first.prompt_token_ids),
                                           first.cap_tokens, len(choices),
                                           prompt_token_ids=first.prompt_token_ids,
                                           use_cached=first.uses_cached_blocks, salt=how.salt,
                                           adapter=first.lora, tenant=how.tenant,
                                           priority=how.priority)
    except PoolTooSmall as exc:
        raise admission_error(exc) from None
    except KVCacheFull as exc:
        raise busy(state, how.tenant, exc) from None


def cache_salt(request: web.Request, state: ServerState, req: GenerationRequest,
                lora_salt: str | None) -> str | None:
    """What keys this request's prefix-cache blocks apart: its LoRA adapter's (whose K/V
    differ from the base model's), its ``cache_salt``, under its API key's own with
    ``--cache-salt-per-key`` (so requests under different keys never share a block,
    whatever salts their clients send); None: the shared cache."""
    parts = [] if lora_salt is None else [lora_salt]
    if state.options.salt_cache_per_key and API_KEY_INDEX in request:
        parts.append(f"key:{request[API_KEY_INDEX]}")
    if req.cache_salt is not None:
        parts.append("salt:" + req.cache_salt)
    return "\0".join(parts) or None
