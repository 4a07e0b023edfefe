"""What goes through the front door (``door.FrontDoor.submit``) and what comes back.

A ``Submission`` is one request as a client sent it, after the HTTP server (or ``LLM``)
parsed it: its prompts (text, tokenized at the door, or token ids), the sampling
parameters its choices share (``max_tokens`` the cap asked for, or None), ``n`` choices a
prompt, an output constraint to compile, its adapter, and whom it is for. The door answers
with a ``PromptRun`` per prompt: its token ids and its ``n`` checked ``EngineRequest``s,
each with its own cap and seed, then the ticket admission granted it.

``Tenant`` (who a request is for) is the admission line's type, named here as part of the
door's vocabulary, so the server needs nothing from admission's rooms.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvledger.engine.admission.order import ANONYMOUS, OTHER, Tenant
from kvledger.engine.admission.ticket import Ticket
from kvledger.engine.core.request import EngineRequest
from kvledger.engine.sampling.params import SamplingParams
from kvledger.engine.settings.lora_config import LoRARequest

if TYPE_CHECKING:  # the grammar compiler pulls llguidance in
    from kvledger.engine.sampling.grammar import GrammarSpec
    from kvledger.engine.sampling.grammar_gate import GrammarGate

__all__ = ["ANONYMOUS", "OTHER", "PromptRun", "Submission", "Tenant"]


@dataclass(frozen=True)
class Submission:
    """One request into the engine. Choice ``k`` answers prompt ``k // n``, with the seed
    ``params.seed + k % n``, so a prompt draws the same tokens in a batch as alone."""

    request_id: str
    prompts: list[str | list[int]]  # text (tokenized at the door) or token ids
    params: SamplingParams           # max_tokens: the cap asked for; None: the rest
    n: int = 1
    grammar: GrammarSpec | None = None  # compiled at the door, shared by the choices
    lora: LoRARequest | None = None      # its adapter; None: the base model
    tenant: Tenant = ANONYMOUS
    priority: int | None = None         # asked; None: the objective's, else its tenant's
    cache_salt: str | None = None        # keys its prefix-cache blocks apart (with the adapter's)
    add_special_tokens: bool = True      # False: a rendered chat template holds its own
    body_bytes: int | None = None        # the request's size: small ones are prepared inline
    published_salt: str | None = None    # the client's own cache_salt: KV events carry it
    objective_priority: int | None = None  # the gateway's InferenceObjective's, in this order
    default_cap: int | None = None  # with no cap asked, at most this (vLLM's completions: 16)
    grammar_gate: GrammarGate | None = None  # where ``grammar`` starts (reasoning's end)


@dataclass
class PromptRun:
    """One prompt of a submission at the door: its ids, its ``n`` choices (each met every
    rule), and, once admitted, its ticket (one reservation per choice)."""

    prompt_ids: list[int]
    choices: list[EngineRequest]
    ticket: Ticket | None = None
    handed: int = 0  # of its reservations, those the engine owns (it releases them)

    @property
    def cap_tokens(self) -> int:
        return self.choices[0].cap_tokens

    @property
    def num_cached_blocks(self) -> int:
        """Its prompt's blocks found in the prefix cache when it was admitted."""
        return 0 if self.ticket is None else self.ticket.reservations[0].num_cached_blocks
