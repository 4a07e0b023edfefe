"""What one chat request asks of ``--reasoning-parser``: ``reasoning_plan`` decides once,
before the request is submitted, whether and how its answers are split.

An output constraint (``response_format``, ``structured_outputs``, a required or named
tool call) applies, as in vLLM 0.32, only once the reasoning ends (``ReasoningPlan.
grammar_gate``): the reasoning is the model's own, the content follows the constraint.
When the chat does not reason (Qwen3's ``enable_thinking: false``) the whole answer is
content, and the constraint applies from the first token; so it does, reasoning included,
under ``--structured-outputs-config '{"enable_in_reasoning": true}'`` (the parser still
splits what the constrained answer holds).
"""

from __future__ import annotations

from kvledger.engine.server.api_errors import bad_request
from kvledger.engine.server.protocol import GenerationRequest
from kvledger.engine.server.reasoning import ReasoningPlan
from kvledger.engine.server.state import ServerState


def reasoning_plan(state: ServerState, req: GenerationRequest) -> ReasoningPlan | None:
    """How ``req``'s answers are split (None: not split, as without the flag)."""
    if req.kind != "chat":
        return None
    tokens = state.reasoning
    if tokens is None:
        if not req.include_reasoning:
            raise bad_request("'include_reasoning': false needs a reasoning parser: this "
                              "server was started without --reasoning-parser, so there is "
                              "no reasoning to drop", "include_reasoning")
        return None
    thinking = tokens.thinking(req.template_kwargs(state.options.default_chat_template_kwargs))
    return ReasoningPlan(tokens, thinking, req.include_reasoning,
                         state.options.structured_outputs_config.enable_in_reasoning)
