"""``LLM(model, **flags).generate(prompts, params)``: offline batch generation, vLLM's shape.

``generate`` and ``chat`` take vLLM 0.32's arguments: prompts as text, token ids or its
prompt dicts (``{"prompt": ...}``, ``{"prompt_token_ids": [...]}``), ``use_tqdm`` (a
progress bar of the prompts finished, or a callable that makes one), ``priority`` (one
for all or one each), ``tokenization_kwargs`` (``add_special_tokens``), and for ``chat``
its template options (``chat_template``, ``add_generation_prompt``,
``continue_final_message``, ``tools``, ``chat_template_kwargs``,
``chat_template_content_format``). What kvledger does not do (images, audio) is BadInput.
``LLM(...)`` takes vLLM's engine arguments as ``kvledger serve`` takes the flags
(``settings/llm_args.py``); ``sleep``, ``wake_up`` and ``reset_prefix_cache`` are the
server's sleep endpoints' calls (``frontend/sleeping.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Coroutine, Mapping
from collections.abc import Sequence as Seq
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kvledger.engine.core.engine import LLMEngine
from kvledger.engine.core.outputs import RequestOutput
from kvledger.engine.errors import BadInput
from kvledger.engine.frontend.door import FrontDoor, LineOptions, Submission
from kvledger.engine.model.chat_template import checked_template
from kvledger.engine.sampling.params import SamplingParams
from kvledger.engine.settings.flag_values import CONTENT_FORMATS
from kvledger.engine.settings.llm_args import config_from_kwargs
from kvledger.engine.settings.lora_config import LoRARequest
from kvledger.engine.settings.structured_outputs_config import StructuredOutputsConfig

# vLLM's prompt dicts (TextPrompt, TokensPrompt): the keys read here; its multimodal
# keys are refused by name.
_PROMPT_KEYS = ("prompt", "prompt_token_ids")
_MULTIMODAL_KEYS = ("multi_modal_data", "mm_processor_kwargs", "multi_modal_uuids")


class LLM:
    """An engine in this process. ``engine_args`` are vLLM's engine arguments, read as
    ``kvledger serve`` reads the same flags (``settings/llm_args.py``): kvledger's own
    (``max_model_len``, ``device``, ...) do what their flags do, vLLM's others are read,
    accepted as changing nothing, or refused with the flag's reason; a flag of the HTTP
    server's is refused as serve's. ``structured_outputs_config`` (a dict of vLLM's keys or
    a ``StructuredOutputsConfig``) says how ``SamplingParams.structured_outputs`` writes
    JSON; ``chat_template`` (a file or the template, as ``--chat-template``) is ``chat``'s
    when it is given none."""

    def __init__(self, model: str, structured_outputs_config: Any = None,
                 chat_template: str | None = None, **engine_args: Any) -> None:
        outputs = (StructuredOutputsConfig() if structured_outputs_config is None
                   else structured_outputs_config
                   if isinstance(structured_outputs_config, StructuredOutputsConfig)
                   else StructuredOutputsConfig.of(structured_outputs_config))
        self._chat_template = None if chat_template is None else checked_template(chat_template)
        config = config_from_kwargs(model, engine_args)
        if config.kv_events_config is not None and config.kv_events_config.enabled:
            raise BadInput("kv_events_config: KV events are published by a server for its "
                           "router (kvledger serve --kv-events-config), not by LLM")
        self.engine = LLMEngine.from_config(config)
        # Its line uncapped: every prompt waits its turn.
        self._door = FrontDoor(self.engine, LineOptions(structured_outputs=outputs))
        self._counter = 0

    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        """vLLM's: give the device memory back (needs ``enable_sleep_mode=True``), as the
        server's ``POST /sleep`` does (``frontend/sleeping.py``): level 1 moves the weights
        to host memory and frees the KV pool, 2 frees the weights too (waking reads them
        again), 0 frees nothing; the prefix cache is emptied. Between calls nothing runs, so
        every ``mode`` (vLLM's ``abort``, ``wait``, ``keep``) is the same; ``generate``
        raises EngineSleeping until ``wake_up``."""
        if mode not in ("abort", "wait", "keep"):
            raise BadInput(f"mode={mode!r}: vLLM's modes are abort, wait and keep")
        _run(self._sleep_gate().sleep(level))

    def wake_up(self, tags: list[str] | None = None) -> bool:
        """vLLM's: take back what ``tags`` name (``weights``, ``kv_cache``; None: all); True
        once all is back."""
        return _run(self._sleep_gate().wake(tags))

    def reset_prefix_cache(self, reset_running_requests: bool = False,
                           reset_connector: bool = False) -> bool:
        """vLLM's: nothing cached is found again (no request runs between calls)."""
        self._door.reset_prefix_cache()
        return True

    def _sleep_gate(self):
        if self._door.sleep is None:
            raise BadInput("sleep and wake_up need LLM(..., enable_sleep_mode=True)")
        return self._door.sleep

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
            list(c), add_generation_prompt, tools, template=chat_template or self._chat_template,
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
        # Asleep (LLM.sleep): EngineSleeping before anything is checked, as the server's.
        with door.sleep.entry() if door.sleep is not None else contextlib.nullcontext():
            for prompt, p, lora, urgency in zip(prompts, params, loras, priorities,
                                                strict=True):
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


def _run(work: Coroutine[Any, Any, Any]) -> Any:
    """The sleep gate's coroutine to its end, on a thread of its own: the caller may be
    inside an event loop already (a notebook), where ``asyncio.run`` is refused."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, work).result()


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
