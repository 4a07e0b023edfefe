"""The request rules the front door applies, each from its owner, in the door's order:
a prompt's ids (the client's checked, a text tokenized: ``encode_all``), its cap
(``caps``: ``admission/cap.py``'s ``output_cap`` with the model's ``max_new_tokens``), each
choice's parameters (``choice_params``: its cap and seed, the model's vocabulary), each
prompt's ``EngineRequest``s and whether the pool could ever hold them (``prompt_runs``:
the ledger's ``check_fits``), what keys its prefix-cache blocks apart (``cache_salt``),
and the bound on a text's tokens that lets a full pool refuse before tokenizing
(``max_prompt_tokens``); a ``SamplingParams.structured_outputs`` is the submission's
output constraint (``constrained``)."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from kvledger.engine.admission.cap import output_cap
from kvledger.engine.admission.headroom import Headroom
from kvledger.engine.core.request import EngineRequest
from kvledger.engine.errors import BadInput
from kvledger.engine.frontend.submission import PromptRun, Submission
from kvledger.engine.kv.block_pool import Salt
from kvledger.engine.sampling import bad_words
from kvledger.engine.sampling.params import SamplingParams

if TYPE_CHECKING:  # the engine pulls torch in
    from kvledger.engine.core.engine import LLMEngine

# A tokenizer emits at most one token per UTF-8 byte plus a few it adds itself (BOS, a
# SentencePiece word prefix); this bound lets a full pool refuse before tokenizing. A
# normalizer that expands text (NFKC ligatures) could break it; the cost is only that a
# request which deserved a 400 gets a 429 first, and its retry the 400.
ADDED_TOKENS_MAX = 8


def constrained(sub: Submission) -> Submission:
    """``sub`` with its parameters' ``structured_outputs`` (vLLM's offline form) as its
    ``grammar`` spec, compiled at the door as a request body's constraint is."""
    wanted = sub.params.structured_outputs
    if wanted is None:
        return sub
    if sub.grammar is not None:
        raise BadInput("give structured_outputs or another output constraint, not both")
    return replace(sub, grammar=wanted.constraint(),
                   params=replace(sub.params, structured_outputs=None))


def encode_all(engine: LLMEngine, sub: Submission) -> list[list[int]]:
    """Each prompt's token ids: the client's checked, a text tokenized."""
    return [_encode(engine, sub, prompt) for prompt in sub.prompts]


def _encode(engine: LLMEngine, sub: Submission, prompt: str | list[int]) -> list[int]:
    if isinstance(prompt, list):
        engine.check_prompt(prompt)  # the client's ids: before anything looks at them
        return list(prompt)
    ids = engine.tokenizer.encode(prompt, add_special_tokens=sub.add_special_tokens)
    if not ids:
        raise BadInput("the prompt encodes to zero tokens", "prompt")
    return ids


def caps(engine: LLMEngine, sub: Submission, ids: list[list[int]]) -> list[int]:
    """Each prompt's output cap (``output_cap``); then the tokenizer's ids checked."""
    tokenizer = engine.tokenizer
    # A request that names no cap: its kind's (completions' 16), else the model's
    # max_new_tokens (vLLM's fallback); a folder's or the override's caps them all.
    default = (sub.default_cap if sub.default_cap is not None
               else tokenizer.sampling_defaults.get("max_tokens"))
    result = [min(output_cap(engine.max_model_len, len(prompt_ids), sub.params.max_tokens,
                             default), tokenizer.max_tokens_cap or engine.max_model_len)
              for prompt_ids in ids]
    for prompt, prompt_ids in zip(sub.prompts, ids, strict=True):
        if not isinstance(prompt, list):  # the tokenizer's ids, checked once they fit
            engine.check_prompt(prompt_ids)
    return result


def choice_params(engine: LLMEngine, sub: Submission, caps: list[int],
                  grammar: Any) -> list[SamplingParams]:
    """Choice ``k``'s parameters: its prompt's cap, the seed offset by ``k % n`` (each
    choice draws its own tokens, reproducibly), the compiled constraint; the token
    ids they name checked against the model's vocabulary (the choices differ only in
    their seeds and caps)."""
    base, n = sub.params, sub.n
    if grammar is not None:
        base = replace(base, grammar=grammar)
    base = bad_words.resolved(base, engine.tokenizer)
    params = []
    for k in range(len(caps) * n):
        seed = base.seed
        if seed is not None and k % n:
            seed = (seed + k % n) % 2**64
        cap = caps[k // n]
        params.append(base if cap == base.max_tokens and seed == base.seed
                      else replace(base, max_tokens=cap, seed=seed))
    engine.check_params(params[0])
    return params


def prompt_runs(engine: LLMEngine, sub: Submission, ids: list[list[int]], caps: list[int],
                params: list[SamplingParams], adapter: Any, priority: int,
                headroom: Headroom) -> list[PromptRun]:
    """Each prompt's run, its choices ready for the engine; PoolTooSmall for one the
    pool could never hold (so ``LLM`` refuses it before anything runs)."""
    runs = []
    for i, (prompt_ids, cap) in enumerate(zip(ids, caps, strict=True)):
        choices = [EngineRequest(prompt_ids, params[i * sub.n + j], cap, adapter, priority,
                                 sub.tenant) for j in range(sub.n)]
        first = choices[0]
        engine.ledger.check_fits(first.num_tokens, sub.n, len(prompt_ids),
                                 share=first.uses_cached_blocks,
                                 kept_blocks=headroom.kept_from(priority)[0])
        runs.append(PromptRun(prompt_ids, choices))
    return runs


def cache_salt(sub: Submission, runs: list[PromptRun]) -> Salt | None:
    """What keys the prompts' prefix-cache blocks apart: the adapter's (its K/V differ
    from the base model's), then the submission's own; None: the shared cache."""
    parts = [salt for salt in (runs[0].choices[0].lora_salt, sub.cache_salt) if salt]
    return Salt("\0".join(parts), sub.published_salt) if parts else None


def max_prompt_tokens(prompt: str | list[int]) -> int:
    """The most tokens ``prompt`` may have once tokenized (its ids' count, a text's bound)."""
    if isinstance(prompt, list):
        return len(prompt)
    return len(prompt.encode()) + ADDED_TOKENS_MAX
