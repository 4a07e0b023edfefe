"""What a generation request's fields become for the engine: a chat's prompt text (the
model's chat template, or the request's own under ``--trust-request-chat-template``), the
output cap (the model's ``max_new_tokens`` when the request sets none), each choice's
``SamplingParams`` (a field the request leaves unset takes the model's default from
``generation_config.json``, else vLLM's neutral value), and ``--max-logprobs``."""

from __future__ import annotations

from typing import Any

from kvledger.engine.errors import BadInput
from kvledger.engine.model.chat_template import ReservedKwargs, compiled
from kvledger.engine.server.api_errors import bad_request
from kvledger.engine.server.chat_options import ChatTemplateOptions
from kvledger.engine.server.protocol import ChatRequest, GenerationRequest
from kvledger.engine.server.state import ServerState


def render_chat(state: ServerState, req: ChatTemplateOptions, messages: list[dict[str, Any]],
                tools: list[dict[str, Any]] | None) -> str:
    """A chat rendered as prompt text: with the request's own template only under
    ``--trust-request-chat-template`` (as vLLM), its ``chat_template_kwargs`` over
    ``--default-chat-template-kwargs``; a 400 naming the field when it cannot be."""
    options = state.options
    if req.chat_template is not None and not options.trust_request_chat_template:
        raise bad_request("a chat_template in the request needs the server's "
                          "--trust-request-chat-template (a template is code the server "
                          "runs); without it the model's template renders every chat",
                          "chat_template")
    kwargs = {**options.default_chat_template_kwargs, **(req.chat_template_kwargs or {})}
    if req.chat_template is not None:
        try:
            compiled(req.chat_template)
        except BadInput as exc:
            raise bad_request(str(exc), "chat_template") from None
    try:
        return state.engine.tokenizer.apply_chat_template(
            messages, add_generation_prompt=req.add_generation_prompt, tools=tools,
            template=req.chat_template, kwargs=kwargs,
            continue_final_message=req.continue_final_message)
    except ReservedKwargs as exc:
        raise bad_request(str(exc), "chat_template_kwargs") from None
    except BadInput as exc:
        raise bad_request(str(exc), "messages") from None


def chat_prompt(state: ServerState, req: ChatRequest) -> str:
    """A chat rendered as prompt text (``render_chat``)."""
    return render_chat(state, req, req.template_messages, req.template_tools)


def check_logprobs(state: ServerState, req: GenerationRequest) -> None:
    """A 400 for more logprobs per token than ``--max-logprobs`` allows."""
    limit = state.options.max_logprobs
    asked = max(req.logprobs_k() or 0, req.prompt_logprobs_k() or 0)
    if asked > limit:
        param = "top_logprobs" if req.kind == "chat" else "logprobs"
        raise bad_request(f"{asked} logprobs per token asked for; this server reports at most "
                          f"{limit} (--max-logprobs)", param)


def default_cap(cap: int, requested: int | None, defaults: dict[str, Any]) -> int:
    """``cap`` (the request's, or the rest of the context when it set none), at most the
    model's ``max_new_tokens`` when the request set none (vLLM's fallback)."""
    default = defaults.get("max_tokens")
    return min(cap, default) if requested is None and default is not None else cap


# Each sampling field a request may leave unset, and vLLM's neutral value for it.
NEUTRAL = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0,
            "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0}


def sampling_params(req: GenerationRequest, cap: int, grammar: Any, index: int,
                    defaults: dict[str, Any] | None = None,
                    kept_special_ids: frozenset[int] = frozenset()) -> Any:
    """One choice's SamplingParams: each field the request set, else the model's default
    (``defaults``: its generation_config.json), else vLLM's neutral value."""
    from kvledger.engine.sampling.params import SamplingParams

    seed = req.seed
    if seed is not None and index:  # each choice draws its own tokens, reproducibly
        seed = (seed + index) % 2**64
    defaults = defaults or {}
    sampling = {name: value if (value := getattr(req, name)) is not None
                else defaults.get(name, neutral) for name, neutral in NEUTRAL.items()}
    try:
        return SamplingParams(
            **sampling, seed=seed,
            max_tokens=cap, stop=req.stop or None, stop_token_ids=req.stop_token_ids,
            ignore_eos=req.ignore_eos, min_tokens=req.min_tokens,
            logit_bias=req.bias, logprobs=req.logprobs_k(),
            prompt_logprobs=req.prompt_logprobs_k(),
            include_stop_str_in_output=req.include_stop_str_in_output,
            skip_special_tokens=req.skip_special_tokens,
            spaces_between_special_tokens=req.spaces_between_special_tokens, grammar=grammar,
            kept_special_ids=kept_special_ids)
    except BadInput as exc:
        raise bad_request(str(exc)) from None
