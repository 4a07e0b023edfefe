"""A request as the engine takes it, and the rules it must meet.

The context cap's rule, ``output_cap``, is admission's (``admission/cap.py``; imported
here, where the engine's ``check_request`` applies it). The other rules a request meets
have one owner each too: its token ids (``check_prompt_ids``,
``check_param_ids``, which ``LLMEngine.check_prompt``/``check_params`` apply with the
model's vocabulary) and whether prompt + cap fits the pool
(``KVLedger.check_fits``). ``LLMEngine.check_request`` applies them all, once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvledger.engine.admission.cap import output_cap
from kvledger.engine.admission.order import ANONYMOUS, Tenant
from kvledger.engine.errors import BadInput
from kvledger.engine.kv.reservation import Reservation
from kvledger.engine.sampling.params import SamplingParams

__all__ = ["EngineRequest", "check_param_ids", "check_prompt_ids", "check_reservation",
           "output_cap"]

if TYPE_CHECKING:
    from kvledger.engine.model.lora_adapter import LoraAdapter


@dataclass(frozen=True)
class EngineRequest:
    """A request that met every rule (``LLMEngine.check_request``, or a server that ran
    the same checks in its own order): ``add_request`` takes it as it is."""

    prompt_token_ids: list[int]
    params: SamplingParams
    cap_tokens: int  # the most tokens it may generate
    lora: LoraAdapter | None = None  # its LoRA adapter; None: the base model
    priority: int = 0  # vLLM's: lower is admitted and seated sooner (--scheduling-policy)
    tenant: Tenant = ANONYMOUS  # whose share it is counted in, at every line (order.py)

    @property
    def lora_salt(self) -> str | None:
        """What keys an adapter's prefix-cache blocks apart from the base model's and other
        adapters' (their K/V differ for the same tokens); None for the base model."""
        return None if self.lora is None else f"lora:{self.lora.lora_int_id}"

    @property
    def num_tokens(self) -> int:
        """What its reservation covers: prompt + cap."""
        return len(self.prompt_token_ids) + self.cap_tokens

    @property
    def uses_cached_blocks(self) -> bool:
        """Prompt logprobs need every prompt position computed: no cached blocks."""
        return self.params.prompt_logprobs is None


def check_prompt_ids(prompt_token_ids: list[int], vocab_size: int) -> None:
    """BadInput unless the ids are a non-empty list of token ids under ``vocab_size``."""
    if not prompt_token_ids:
        raise BadInput("the prompt is empty", "prompt")
    if not all(isinstance(t, int) and 0 <= t < vocab_size for t in prompt_token_ids):
        raise BadInput(f"prompt token ids must be integers in [0, {vocab_size})", "prompt")


def check_param_ids(params: SamplingParams, vocab_size: int) -> None:
    """BadInput unless the token ids ``params`` names (``logit_bias``'s,
    ``allowed_token_ids``) are under ``vocab_size``."""
    for name, ids in (("logit_bias", params.logit_bias),
                      ("allowed_token_ids", params.allowed_token_ids)):
        if ids and max(ids) >= vocab_size:
            raise BadInput(f"{name} token ids must be in [0, {vocab_size}), got {max(ids)}",
                           name)


def check_reservation(reservation: Reservation, request: EngineRequest,
                      needed_blocks: int) -> None:
    """BadInput unless ``reservation`` was made for ``request``: ``needed_blocks`` or more,
    for its prompt, and without cached blocks when it needs every prompt position."""
    if reservation.num_blocks < needed_blocks:
        raise BadInput(f"the reservation holds {reservation.num_blocks} blocks; prompt + "
                       f"cap needs {needed_blocks}")
    # Its cached blocks and keys were found from the prompt it was made for.
    if (reservation.prompt_token_ids is not None
            and list(reservation.prompt_token_ids) != list(request.prompt_token_ids)):
        raise BadInput("the reservation was made for another prompt")
    if reservation.num_cached_blocks and not request.uses_cached_blocks:
        raise BadInput("a request with prompt_logprobs needs every prompt position computed; "
                       "its reservation must not use cached blocks")
