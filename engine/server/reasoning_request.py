"""What one chat request asks of ``--reasoning-parser``: ``reasoning_plan`` decides once,
before the request is submitted, whether and how its answers are split, and refuses what
this server cannot serve beside a reasoning parser.

vLLM applies an output constraint (``response_format``, ``structured_outputs``, a
required or named tool call) only after the reasoning ends; kvledger's grammar constrains
an answer from its first token, so with a parser that reasons it would force the
reasoning itself into the schema. That combination is a 400 naming the field, unless the
chat does not reason (Qwen3's ``enable_thinking: false``): then the whole answer is
content, and the constraint applies from the first token as in vLLM.
"""

from __future__ import annotations

from kvledger.engine.server.api_errors import bad_request
from kvledger.engine.server.protocol import GenerationRequest
from kvledger.engine.server.reasoning import ReasoningPlan
from kvledger.engine.server.state import ServerState
from kvledger.engine.server.structured_outputs import constraint_field
from kvledger.engine.server.tools.calls import ToolPlan


def reasoning_plan(state: ServerState, req: GenerationRequest,
                   tools: ToolPlan) -> ReasoningPlan | None:
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
    if thinking and (tools.grammar is not None or req.grammar() is not None):
        field = "tool_choice" if tools.grammar is not None else constraint_field(req)
        raise bad_request(
            f"'{field}' cannot be served beside --reasoning-parser {tokens.name}: this server "
            "constrains an answer from its first token, where vLLM waits for the reasoning "
            "to end; drop the constraint, or turn reasoning off (chat_template_kwargs "
            "{\"enable_thinking\": false}, qwen3)", field)
    return ReasoningPlan(tokens, thinking, req.include_reasoning)
