"""``LLM(model, **flags).generate(prompts, params)``: offline batch generation, vLLM's shape."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Any

from kvledger.engine.checkpoint.hub.uri import model_reference
from kvledger.engine.core.engine import LLMEngine
from kvledger.engine.core.outputs import RequestOutput
from kvledger.engine.errors import BadInput
from kvledger.engine.frontend.door import FrontDoor, LineOptions, Submission
from kvledger.engine.sampling.params import SamplingParams
from kvledger.engine.settings.config import EngineConfig
from kvledger.engine.settings.lora_config import LoRARequest
from kvledger.engine.settings.structured_outputs_config import StructuredOutputsConfig


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

    def chat(self, messages: list[dict] | Seq[list[dict]],
             sampling_params: SamplingParams | Seq[SamplingParams] | None = None
             ) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of ``{"role", "content"}``) or
        several, through the model's chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tokenizer = self.engine.tokenizer
        # The template writes the BOS token itself.
        prompts = [tokenizer.encode(tokenizer.apply_chat_template(list(c)), add_special_tokens=False)
                   for c in conversations]
        return self.generate(prompts, sampling_params)

    def generate(self, prompts: str | list[int] | Seq[str | list[int]],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
                 priority: Seq[int] | None = None) -> list[RequestOutput]:
        """Run every prompt to completion; outputs in the order of ``prompts``.

        Every prompt is checked before anything runs, at the engine's front door as the
        server's requests are (``FrontDoor.prepare``: BadInput for one the model cannot run
        or the pool could never hold); then prompts are admitted in order as the KV ledger
        allows (the door's line, uncapped), so more prompts than the pool holds at once
        simply wait their turn.
        ``lora_request`` (vLLM's) runs every prompt with that LoRA adapter, or each with its
        own (a list; None for the base model); the engine needs ``enable_lora=True``. A prompt the engine fails alone (a fault in its sampling,
        or in a forward pass it was part of) comes back with ``finish_reason == "error"``
        and ``error`` saying why; the others are unaffected. ``priority`` (vLLM's, one per
        prompt, lower first) orders the line under ``scheduling_policy="priority"``.
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:  # the model's defaults (--generation-config), as vLLM's
            sampling_params = SamplingParams(**self.engine.tokenizer.sampling_defaults)
        params = ([sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams)
                  else list(sampling_params))
        if len(params) != len(prompts):
            raise BadInput(f"{len(prompts)} prompts but {len(params)} sampling params")
        loras = (list(lora_request) if isinstance(lora_request, list | tuple)
                 else [lora_request] * len(prompts))
        if len(loras) != len(prompts):
            raise BadInput(f"{len(prompts)} prompts but {len(loras)} LoRA requests")
        priorities = [None] * len(prompts) if priority is None else list(priority)
        if len(priorities) != len(prompts):
            raise BadInput(f"{len(prompts)} prompts but {len(priorities)} priorities")
        door, runs, texts = self._door, {}, {}
        for prompt, p, lora, urgency in zip(prompts, params, loras, priorities, strict=True):
            self._counter += 1
            request_id = f"llm-{self._counter}"
            ids_or_text = prompt if isinstance(prompt, str) else list(prompt)
            runs[request_id] = door.prepare(Submission(request_id, [ids_or_text], p, lora=lora,
                                                       priority=urgency))
            if isinstance(prompt, str):
                texts[request_id] = prompt
        finished = door.run_offline(runs)
        for request_id, text in texts.items():
            finished[request_id].prompt = text
        return [finished[request_id] for request_id in runs]
