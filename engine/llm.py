"""``LLM(model, **flags).generate(prompts, params)``: offline batch generation, vLLM's shape."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence as Seq
from concurrent.futures import Future
from dataclasses import replace

from kvledger.engine.admission.line import Admission, Ticket
from kvledger.engine.checkpoint.hub.uri import model_reference
from kvledger.engine.config import EngineConfig
from kvledger.engine.core.engine import LLMEngine
from kvledger.engine.core.outputs import RequestOutput
from kvledger.engine.core.request import EngineRequest
from kvledger.engine.errors import BadInput
from kvledger.engine.lora_config import LoRARequest
from kvledger.engine.sampling.params import SamplingParams


class LLM:
    """An engine in this process. ``flags`` are EngineConfig's fields (vLLM's names),
    e.g. ``LLM("/models/x", max_model_len=512, max_num_seqs=8, device="cpu")``."""

    def __init__(self, model: str, **flags) -> None:
        resolved = model_reference(str(model))  # a bare ORG/NAME is a hub model, as in vLLM
        if resolved != str(model):
            flags.setdefault("served_model_name", str(model))
        try:
            config = EngineConfig(model=resolved, **flags)
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
                 lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
                 priority: Seq[int] | None = None) -> list[RequestOutput]:
        """Run every prompt to completion; outputs in the order of ``prompts``.

        Every prompt is checked before anything runs (``LLMEngine.check_request``: BadInput
        for one the model cannot run or the pool could never hold); then prompts are
        admitted in order as the KV ledger allows (the server's ``Admission``, its line
        uncapped), so more prompts than the pool holds at once simply wait their turn.
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
        priorities = [0] * len(prompts) if priority is None else list(priority)
        if len(priorities) != len(prompts):
            raise BadInput(f"{len(prompts)} prompts but {len(priorities)} priorities")
        engine = self.engine
        if any(priorities) and engine.config.scheduling_policy != "priority":
            raise BadInput("priority needs scheduling_policy='priority' (vLLM's "
                           "--scheduling-policy)")
        requests = []
        for prompt, p, lora, urgency in zip(prompts, params, loras, priorities, strict=True):
            ids = engine.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            request = replace(engine.check_request(ids, p, lora), priority=urgency)
            self._counter += 1
            requests.append((f"llm-{self._counter}", request))
        texts = {request_id: prompt for (request_id, _), prompt in zip(requests, prompts,
                                                                      strict=True)
                 if isinstance(prompt, str)}
        finished = self._run(requests, texts)
        return [finished[request_id] for request_id, _ in requests]

    def _run(self, requests: list[tuple[str, EngineRequest]],
             texts: dict[str, str]) -> dict[str, RequestOutput]:
        """Admit ``requests`` through the server's own admission line, in order, with no cap
        on the line nor on the wait: each is handed to the engine as its reservation is
        granted, and the line moves on after every step (finished requests gave their blocks
        back; over-committing, running ones drew theirs). The server awaits ``Admission.admit``
        on its event loop; here grants arrive in plain futures, since this loop steps the
        engine itself."""
        engine = self.engine
        admission = Admission(engine.ledger, max_model_len=engine.max_model_len,
                              max_queue_wait_s=None, max_queue_len=None,
                              scheduling_policy=engine.config.scheduling_policy,
                              headroom=engine.headroom)
        line: dict[str, tuple[EngineRequest, Future[Ticket]]] = {}
        granted_ids: deque[str] = deque()  # in the order the line granted them
        tickets: dict[str, Ticket] = {}
        finished: dict[str, RequestOutput] = {}
        try:
            for request_id, request in requests:
                granted: Future[Ticket] = Future()
                granted.add_done_callback(lambda _, rid=request_id: granted_ids.append(rid))
                line[request_id] = (request, granted)
                admission.line_up(request_id, len(request.prompt_token_ids), request.cap_tokens,
                                  granted, prompt_token_ids=request.prompt_token_ids,
                                  use_cached=request.uses_cached_blocks, salt=request.lora_salt,
                                  adapter=request.lora, priority=request.priority)
            while line or engine.has_unfinished_requests():
                while granted_ids:  # handed over as granted, whatever their order in the list
                    request_id = granted_ids.popleft()
                    request, granted = line.pop(request_id)
                    tickets[request_id] = ticket = granted.result()
                    engine.add_request(request_id, request, reservation=ticket.reservation)
                for out in engine.step():
                    if out.finished:
                        out.prompt = texts.get(out.request_id)
                        finished[out.request_id] = out
                        admission.done(tickets.pop(out.request_id))
                # Over-committing, the ledger's verdict on the head moves as requests write.
                admission.capacity_changed()
        except BaseException:  # Ctrl-C or a failed step: give every block back
            engine.abort_all()
            for _, granted in line.values():
                if granted.done():  # granted, never handed to the engine
                    admission.give_back(granted.result().reservations)
            raise
        return finished
