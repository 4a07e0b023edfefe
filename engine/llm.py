"""``LLM(model, **flags).generate(prompts, params)``: offline batch generation, vLLM's shape.

``generate`` and ``chat`` take vLLM 0.32's arguments: prompts as text, token ids or its
prompt dicts (``{"prompt": ...}``, ``{"prompt_token_ids": [...]}``), ``use_tqdm`` (a
progress bar of the prompts finished, or a callable that makes one), ``priority`` (one
for all or one each), ``tokenization_kwargs`` (``add_special_tokens``), and for ``chat``
its template options (``chat_template``, ``add_generation_prompt``,
``continue_final_message``, ``tools``, ``chat_template_kwargs``,
``chat_template_content_format``). What kvledger does not do (images, audio) is BadInput.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from collections.abc import Sequence as Seq
from typing import Any

from kvledger.engine.checkpoint.hub.uri import model_reference
from kvledger.engine.core.engine import LLMEngine
from kvledger.engine.core.outputs import RequestOutput
from kvledger.engine.errors import BadInput
from kvledger.engine.frontend.door import FrontDoor, LineOptions, Submission
from kvledger.engine.sampling.params import SamplingParams
from kvledger.engine.settings.config import EngineConfig
from kvledger.engine.settings.flag_values import CONTENT_FORMATS
from kvledger.engine.settings.lora_config import LoRARequest
from kvledger.engine.settings.structured_outputs_config import StructuredOutputsConfig

# vLLM's prompt dicts (TextPrompt, TokensPrompt): the keys read here; its multimodal
# keys are refused by name.
_PROMPT_KEYS = ("prompt", "prompt_token_ids")
_MULTIMODAL_KEYS = ("multi_modal_data", "mm_processor_kwargs", "multi_modal_uuids")


class LLM:
    """An engine in this process. ``flags`` are EngineConfig's fields (vLLM's names),
    e.g. ``LLM("/models/x", max_model_len=512, max_num_seqs=8, device="cpu")``, and
    vLLM's ``structured_outputs_config`` (a dict of its keys or a
    ``StructuredOutputsConfig``: how ``SamplingParams.structured_outputs`` writes JSON)."""

    def __init__(self, model: str, structured_outputs_config: Any = None, **flags) -> None:
        resolved = model_reference(str(model))  # a bare ORG/NAME is a hub model, as in vLLM
        if resolved != str(model):
            flags.setdefault("served_model_name", str(model))
        outputs = (StructuredOutputsConfig() if structured_outputs_config is None
                   else structured_outputs_config
                   if isinstance(structured_outputs_config, StructuredOutputsConfig)
                   else StructuredOutputsConfig.of(structured_outputs_config))
        try:
            config = EngineConfig(model=resolved, **flags)
        except TypeError as exc:
            raise BadInput(f"unknown engine flag: {exc}") from None
        if config.kv_events_config is not None and config.kv_events_config.enabled:
            raise BadInput("kv_events_config: KV events are published by a server for its "
                           "router (kvledger serve --kv-events-config), not by LLM")
        self.engine = LLMEngine.from_config(config)
        # Its line uncapped: every prompt waits its turn.
        self._door = FrontDoor(self.engine, LineOptions(structured_outputs=outputs))
        self._counter = 0

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """The model's own defaults (its generation_config.json), as vLLM's."""
        return SamplingParams(**self.engine.tokenizer.sampling_defaults)

    def chat(self, messages: list[dict] | Seq[list[dict]],
             sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
             use_tqdm: bool | Callable[..., Any] = True,
             lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
             priority: int | Seq[int] | None = None, chat_template: str | None = None,
             chat_template_content_format: str = "auto", add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: list[dict[str, Any]] | None = None,
             chat_template_kwargs: dict[str, Any] | None = None,
             tokenization_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of ``{"role", "content"}``) or
        several, through the model's chat template (or ``chat_template``), as vLLM's."""
        if add_generation_prompt and continue_final_message:
            raise BadInput("continue_final_message and add_generation_prompt cannot both be "
                           "true: set add_generation_prompt=False to continue the last message")
        if chat_template_content_format not in CONTENT_FORMATS:
            raise BadInput(f"chat_template_content_format must be one of "
                           f"{', '.join(CONTENT_FORMATS)}, got {chat_template_content_format!r}")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tokenizer = self.engine.tokenizer
        # The template writes the BOS token itself.
        prompts = [tokenizer.apply_chat_template(
            list(c), add_generation_prompt, tools, template=chat_template,
            kwargs=chat_template_kwargs, continue_final_message=continue_final_message,
            content=chat_template_content_format) for c in conversations]
        return self.generate(prompts, sampling_params, lora_request, priority,
                             use_tqdm=use_tqdm, tokenization_kwargs={
                                 "add_special_tokens": False, **(tokenization_kwargs or {})})

    def generate(self, prompts: Any, sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
                 priority: int | Seq[int] | None = None, *,
                 use_tqdm: bool | Callable[..., Any] = True,
                 tokenization_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """Run every prompt to completion; outputs in the order of ``prompts``.

        Every prompt is checked before anything runs, at the engine's front door as the
        server's requests are (``FrontDoor.prepare``: BadInput for one the model cannot run
        or the pool could never hold); then prompts are admitted in order as the KV ledger
        allows (the door's line, uncapped), so more prompts than the pool holds at once
        simply wait their turn.
        ``lora_request`` (vLLM's) runs every prompt with that LoRA adapter, or each with its
        own (a list; None for the base model); the engine needs ``enable_lora=True``. A prompt the engine fails alone (a fault in its sampling,
        or in a forward pass it was part of) comes back with ``finish_reason == "error"``
        and ``error`` saying why; the others are unaffected. ``priority`` (vLLM's, lower
        first, one for all or one per prompt) orders the line under
        ``scheduling_policy="priority"``.
        """
        prompts = [_prompt(p) for p in _listed(prompts)]
        if sampling_params is None:  # the model's defaults (--generation-config), as vLLM's
            sampling_params = self.get_default_sampling_params()
        params = _each(sampling_params, SamplingParams, len(prompts), "sampling params")
        loras = _each(lora_request, LoRARequest | None, len(prompts), "LoRA requests")
        priorities = _each(priority, int | None, len(prompts), "priorities")
        add_special = _add_special_tokens(tokenization_kwargs)
        door, runs, texts = self._door, {}, {}
        for prompt, p, lora, urgency in zip(prompts, params, loras, priorities, strict=True):
            self._counter += 1
            request_id = f"llm-{self._counter}"
            runs[request_id] = door.prepare(Submission(
                request_id, [prompt], p, lora=lora, priority=urgency,
                add_special_tokens=True if add_special is None else add_special))
            if isinstance(prompt, str):
                texts[request_id] = prompt
        with _progress(use_tqdm, len(runs)) as tick:
            finished = door.run_offline(runs, tick)
        for request_id, text in texts.items():
            finished[request_id].prompt = text
        return [finished[request_id] for request_id in runs]


def _listed(prompts: Any) -> list[Any]:
    """One prompt (text, ids, a prompt dict) or a sequence of them, as a list."""
    if isinstance(prompts, str | Mapping) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        return [prompts]
    return list(prompts)


def _prompt(prompt: Any) -> str | list[int]:
    """Text or token ids, from vLLM's prompt forms."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, Mapping):
        if any(key in prompt for key in _MULTIMODAL_KEYS):
            raise BadInput("kvledger serves text models: a prompt's multi_modal_data is "
                           "not supported")
        unknown = sorted(str(key) for key in prompt if key not in _PROMPT_KEYS)
        given = [key for key in _PROMPT_KEYS if key in prompt]
        if unknown or len(given) != 1:
            raise BadInput("a prompt dict holds exactly one of 'prompt' (text) or "
                           f"'prompt_token_ids', got keys {sorted(map(str, prompt))}")
        return _prompt(prompt[given[0]])
    return list(prompt)


def _each(value: Any, kind: Any, count: int, what: str) -> list[Any]:
    """``value`` for every prompt (one given) or one each (a list or tuple of ``count``)."""
    if isinstance(value, list | tuple):
        if len(value) != count:
            raise BadInput(f"{count} prompts but {len(value)} {what}")
        return list(value)
    if not isinstance(value, kind):
        raise BadInput(f"{what}: expected one or a list, got {type(value).__name__}")
    return [value] * count


def _add_special_tokens(kwargs: dict[str, Any] | None) -> bool | None:
    """``tokenization_kwargs``' ``add_special_tokens`` (None: not given); any other key is
    BadInput (kvledger tokenizes prompts whole, with no truncation)."""
    kwargs = dict(kwargs or {})
    value = kwargs.pop("add_special_tokens", None)
    if kwargs:
        raise BadInput(f"tokenization_kwargs: only add_special_tokens is supported, got "
                       f"{', '.join(sorted(map(str, kwargs)))}")
    if value is not None and not isinstance(value, bool):
        raise BadInput("tokenization_kwargs: add_special_tokens must be true or false")
    return value


class _progress:
    """``use_tqdm``'s bar over the prompts finished: tqdm's (True), one the callable
    makes (vLLM's ``functools.partial(tqdm, leave=False)``), or none (False)."""

    def __init__(self, use_tqdm: bool | Callable[..., Any], total: int) -> None:
        self._bar = None
        if callable(use_tqdm):
            self._bar = use_tqdm(total=total, desc="Processed prompts")
        elif use_tqdm:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total, desc="Processed prompts", dynamic_ncols=True)

    def __enter__(self) -> Callable[[RequestOutput], None] | None:
        bar = self._bar
        return None if bar is None else (lambda _output: bar.update(1))

    def __exit__(self, *_exc: object) -> None:
        if self._bar is not None:
            self._bar.close()
