"""The context-cap rule: how many tokens a request may generate.

``output_cap`` is the one owner of the rule every caller applies to ``max_tokens`` (the
engine's ``check_request``, the server through ``Admission.effective_cap``): a prompt at
or over the context is too long (PromptTooLong), a cap over the room left is too large
(CapTooLarge), and an unset cap is the rest of the context, at most the model's own
``max_new_tokens`` (its generation_config.json, vLLM's fallback) when it has one.
"""

from __future__ import annotations

from kvledger.engine.errors import CapTooLarge, PromptTooLong


def output_cap(max_model_len: int, num_prompt_tokens: int, max_tokens: int | None,
               model_default: int | None = None) -> int:
    """The most tokens a request may generate: ``max_tokens``, or the rest of the context
    when it is unset (at most ``model_default``, the model's ``max_new_tokens``). PromptTooLong when the prompt leaves no room for one output token;
    CapTooLarge when ``max_tokens`` is more than the room."""
    if num_prompt_tokens >= max_model_len:
        raise PromptTooLong(num_prompt_tokens, max_model_len)
    room = max_model_len - num_prompt_tokens
    if max_tokens is None:
        return room if model_default is None else min(room, model_default)
    if max_tokens > room:
        raise CapTooLarge(num_prompt_tokens, max_tokens, max_model_len)
    return max_tokens
