"""``LLM(model, **flags).generate(prompts, params)``: offline batch generation, vLLM's shape."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence as Seq

from kvledger.engine.config import EngineConfig
from kvledger.engine.core.engine import LLMEngine
from kvledger.engine.core.outputs import RequestOutput
from kvledger.engine.errors import AdmissionRejected, BadInput
from kvledger.engine.lora_config import LoRARequest
from kvledger.engine.sampling.params import SamplingParams


class LLM:
    """An engine in this process. ``flags`` are EngineConfig's fields (vLLM's names),
    e.g. ``LLM("/models/x", max_model_len=512, max_num_seqs=8, device="cpu")``."""

    def __init__(self, model: str, **flags) -> None:
        try:
            config = EngineConfig(model=str(model), **flags)
        except TypeError as exc:
            raise BadInput(f"unknown engine flag: {exc}") from None
        self.engine = LLMEngine.from_config(config)
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
                 lora_request: LoRARequest | Seq[LoRARequest | None] | None = None
                 ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs in the order of ``prompts``.

        Every prompt is checked before anything runs (``LLMEngine.check_request``: BadInput
        for one the model cannot run or the pool could never hold); then prompts are
        admitted as the KV ledger allows, so more prompts than the pool holds at once
        simply wait their turn. ``lora_request`` (vLLM's) runs every prompt with that LoRA
        adapter, or each with its own (a list; None for the base model); the engine needs
        ``enable_lora=True``. A prompt the engine fails alone (a fault in its sampling,
        or in a forward pass it was part of) comes back with ``finish_reason == "error"``
        and ``error`` saying why; the others are unaffected.
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = ([sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams)
                  else list(sampling_params))
        if len(params) != len(prompts):
            raise BadInput(f"{len(prompts)} prompts but {len(params)} sampling params")
        loras = (list(lora_request) if isinstance(lora_request, list | tuple)
                 else [lora_request] * len(prompts))
        if len(loras) != len(prompts):
            raise BadInput(f"{len(prompts)} prompts but {len(loras)} LoRA requests")
        engine = self.engine
        queue = deque()
        for prompt, p, lora in zip(prompts, params, loras, strict=True):
            ids = engine.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            request = engine.check_request(ids, p, lora)
            self._counter += 1
            queue.append((f"llm-{self._counter}", prompt, request))
        order = [request_id for request_id, *_ in queue]
        texts = {request_id: prompt for request_id, prompt, *_ in queue if isinstance(prompt, str)}
        finished: dict[str, RequestOutput] = {}
        try:
            while queue or engine.has_unfinished_requests():
                while queue:
                    request_id, _, request = queue[0]
                    try:
                        engine.add_request(request_id, request)
                    except AdmissionRejected:
                        break  # wait for running requests to release their blocks
                    queue.popleft()
                for out in engine.step():
                    if out.finished:
                        out.prompt = texts.get(out.request_id)
                        finished[out.request_id] = out
        except BaseException:  # Ctrl-C or a failed step: give every block back
            engine.abort_all()
            raise
        return [finished[request_id] for request_id in order]
