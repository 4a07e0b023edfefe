"""What a generation request's fields become for the engine: a chat's prompt text (the
model's chat template, or the request's own under ``--trust-request-chat-template``), the
``SamplingParams`` (a field the request leaves unset takes the model's default from
``generation_config.json``, else vLLM's neutral value), and ``--max-logprobs``. The cap
itself (the model's ``max_new_tokens`` when the request sets none) is the engine's front
door's: it needs the prompt's tokens."""

from __future__ import annotations

from typing import Any

from kvledger.engine.errors import BadInput
from kvledger.engine.model.chat_template import ReservedKwargs, compiled
from kvledger.engine.model.template_bounds import TemplateTooCostly
from kvledger.engine.server.api_errors import bad_request
from kvledger.engine.server.chat_options import ChatTemplateOptions
from kvledger.engine.server.protocol import ChatRequest, GenerationRequest
from kvledger.engine.server.state import ServerState


def render_size(body_bytes: int, req: ChatTemplateOptions) -> int | None:
    """The size ``off_loop`` judges a chat's rendering by: its body's, or None (always off
    the loop) with its own template, code whose cost its body does not bound."""
    return None if req.chat_template is not None else body_bytes


def render_chat(state: ServerState, req: ChatTemplateOptions, messages: list[dict[str, Any]],
                tools: list[dict[str, Any]] | None) -> str:
    """A chat rendered as prompt text: with the request's own template only under
    ``--trust-request-chat-template`` (as vLLM), its ``chat_template_kwargs`` (and a chat's
    ``reasoning_effort``) over ``--default-chat-template-kwargs``; a 400 naming the field
    when it cannot be."""
    options = state.options
    if req.chat_template is not None and not options.trust_request_chat_template:
        raise bad_request("a chat_template in the request needs the server's "
                          "--trust-request-chat-template (a template is code the server "
                          "runs); without it the model's template renders every chat",
                          "chat_template")
    kwargs = req.template_kwargs(options.default_chat_template_kwargs)
    if req.chat_template is not None:
        try:
            compiled(req.chat_template, untrusted=True)
        except BadInput as exc:
            raise bad_request(str(exc), "chat_template") from None
    try:
        return state.door.tokenizer.apply_chat_template(
            messages, add_generation_prompt=req.add_generation_prompt, tools=tools,
            template=req.chat_template, kwargs=kwargs,
            continue_final_message=req.continue_final_message,
            content=options.chat_template_content_format)
    except ReservedKwargs as exc:
        raise bad_request(str(exc), "chat_template_kwargs") from None
    except TemplateTooCostly as exc:
        raise bad_request(str(exc), "chat_template") from None
    except BadInput as exc:
        raise bad_request(str(exc), "messages") from None


def chat_prompt(state: ServerState, req: ChatRequest) -> str:
    """A chat rendered as prompt text (``render_chat``): with its tools, unless its
    ``tool_choice`` is ``"none"`` under ``--exclude-tools-when-tool-choice-none`` (vLLM's
    rule, for a chat and a Responses request alike)."""
    excluded = req.tool_choice == "none" and state.options.exclude_tools_when_tool_choice_none
    return render_chat(state, req, req.template_messages, None if excluded else req.template_tools)


def check_logprobs(state: ServerState, req: GenerationRequest) -> None:
    """A 400 for more logprobs per token than ``--max-logprobs`` allows."""
    limit = state.options.max_logprobs
    asked = max(req.logprobs_k() or 0, req.prompt_logprobs_k() or 0)
    if asked > limit:
        param = "top_logprobs" if req.kind == "chat" else "logprobs"
        raise bad_request(f"{asked} logprobs per token asked for; this server reports at most "
                          f"{limit} (--max-logprobs)", param)


# Each sampling field a request may leave unset, and vLLM's neutral value for it.
NEUTRAL = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0,
            "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0}


def sampling_params(req: GenerationRequest, defaults: dict[str, Any] | None = None,
                    kept_special_ids: frozenset[int] = frozenset()) -> Any:
    """The SamplingParams a request's choices share: each field the request set, else the
    model's default (``defaults``: its generation_config.json), else vLLM's neutral value;
    ``max_tokens`` the cap it asked (None: the door's rule). The engine's front door gives
    each choice its cap and seed (``FrontDoor.submit``)."""
    from kvledger.engine.sampling.params import SamplingParams

    defaults = defaults or {}
    sampling = {name: value if (value := getattr(req, name)) is not None
                else defaults.get(name, neutral) for name, neutral in NEUTRAL.items()}
    try:
        return SamplingParams(
            **sampling, seed=req.seed,
            max_tokens=req.cap, stop=req.stop or None, stop_token_ids=req.stop_token_ids,
            ignore_eos=req.ignore_eos, min_tokens=req.min_tokens,
            logit_bias=req.bias, logprobs=req.logprobs_k(),
            allowed_token_ids=req.allowed_token_ids, bad_words=req.bad_words,
            prompt_logprobs=req.prompt_logprobs_k(),
            include_stop_str_in_output=req.include_stop_str_in_output,
            skip_special_tokens=req.skip_special_tokens,
            spaces_between_special_tokens=req.spaces_between_special_tokens,
            kept_special_ids=kept_special_ids)
    except BadInput as exc:
        raise bad_request(str(exc)) from None
