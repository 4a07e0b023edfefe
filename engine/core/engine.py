"""The engine loop: admit requests against the KV ledger (``check_request``, then
``add_request``, which owns the reservation from then on), then ``step()`` = schedule ->
run the model -> sample -> postprocess.

``add_request`` and ``abort_request`` may be called from any thread while ``step()`` runs
in another: the engine's ``Intake`` (``intake.py``) queues them for the next step.
"""

from __future__ import annotations

import logging
import time

import torch

from kvledger.engine.admission.headroom import Headroom
from kvledger.engine.core import request as rules
from kvledger.engine.core.cpu_threads import ThreadGovernor
from kvledger.engine.core.intake import Intake
from kvledger.engine.core.lora_registry import LoraRegistry
from kvledger.engine.core.outputs import RequestOutput, request_output
from kvledger.engine.core.request import EngineRequest
from kvledger.engine.core.runner import ModelRunner, StepOutput
from kvledger.engine.core.scheduler import ScheduledBatch, Scheduler
from kvledger.engine.core.sequence import Sequence
from kvledger.engine.core.stall import StallWatch
from kvledger.engine.errors import AdmissionRejected, BadInput, EngineFailed, NonFiniteLogits
from kvledger.engine.kv.ledger import KVLedger
from kvledger.engine.kv.reservation import Reservation
from kvledger.engine.model.lora_adapter import LoraAdapter
from kvledger.engine.model.tokenizer import Tokenizer
from kvledger.engine.planner.plan import Plan
from kvledger.engine.sampling import bad_words
from kvledger.engine.sampling.logprobs import TokenLogprobs
from kvledger.engine.sampling.params import SamplingParams
from kvledger.engine.sampling.sampler import Sampled, Sampler, sample_each
from kvledger.engine.settings.config import EngineConfig
from kvledger.engine.settings.lora_config import LoRARequest

log = logging.getLogger("kvledger.engine")

# Failed forward passes in a row after which the engine is broken, not unlucky: one out-of-memory
# fails its step's requests; three in a row (the cache emptied after each) mean none can run.
MAX_CONSECUTIVE_FAILED_STEPS = 3


class LLMEngine:
    def __init__(self, config: EngineConfig, plan: Plan, tokenizer: Tokenizer,
                 runner: ModelRunner, ledger: KVLedger) -> None:
        self.config = config
        self.plan = plan
        self.tokenizer = tokenizer
        self.runner = runner
        self.ledger = ledger
        self.max_model_len = plan.max_model_len
        self.model_name = config.served_model_name or config.model
        # With --enable-lora: the adapters served and loaded; a batch holds max_loras at most.
        self.loras = (LoraRegistry(config, runner.config, runner.dtype) if config.enable_lora
                      else None)
        self.headroom = Headroom.of(config.priority_headroom, config.headroom_priority,
                                    ledger.num_blocks, plan.max_num_seqs)  # admission, seats
        if self.headroom.blocks:
            log.info("headroom: %s", self.headroom.describe())
        self.scheduler = Scheduler(ledger, plan.max_num_seqs, plan.max_num_batched_tokens,
                                   config.max_loras if config.enable_lora else None, self.headroom)
        self.sampler = Sampler(config.seed, runner.device, tokenizer.eos_token_ids,
                               config.logprobs_mode)
        self._shared_generator = self.sampler.generator  # unseeded rows draw from it
        self.intake = Intake(self.scheduler)  # what add_request and abort_request queue
        self.consecutive_failed_steps = 0
        self.num_prefill_tokens = 0  # prompt tokens computed (not those found in the cache)
        self.stall_watch = StallWatch()  # requests here and none advancing: a bug, made loud
        self.cpu_threads = ThreadGovernor.for_engine(torch, runner.device.type, config)

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLMEngine:
        """Plan -> load weights -> profile -> re-plan with measured figures -> allocate
        the KV pool (``startup.build``). Raises DoesNotFit (the same report as ``kvledger
        plan``) if either plan does not fit, BadInput for an unsupported or broken
        checkpoint."""
        from kvledger.engine.core.startup import build

        return cls(config, *build(config))

    # -- admission (any thread) -------------------------------------------------------

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams,
                      lora_request: LoRARequest | None = None) -> EngineRequest:
        """Every rule a request must meet, in this order: its prompt ids (``check_prompt``),
        its params (``check_params``), the context cap (``output_cap``), the pool
        (``KVLedger.check_fits``) and its adapter (``resolve_lora``); BadInput
        (PromptTooLong, CapTooLarge, PoolTooSmall...) for the first it breaks."""
        self.check_prompt(prompt_token_ids)
        params = bad_words.resolved(params, self.tokenizer)
        self.check_params(params)
        cap = rules.output_cap(self.max_model_len, len(prompt_token_ids), params.max_tokens)
        self.ledger.check_fits(len(prompt_token_ids) + cap)
        return EngineRequest(list(prompt_token_ids), params, cap, self.resolve_lora(lora_request))

    def resolve_lora(self, lora_request: LoRARequest | None) -> LoraAdapter | None:
        """The loaded adapter a request asks for (BadInput when it cannot run here)."""
        if lora_request is None:
            return None
        if self.loras is None:
            raise BadInput(f"LoRA adapter {lora_request.lora_name!r} requested, but the "
                           "engine runs without --enable-lora")
        return self.loras.resolve(lora_request)

    def check_prompt(self, prompt_token_ids: list[int]) -> None:  # request.check_prompt_ids
        rules.check_prompt_ids(prompt_token_ids, self.runner.config.vocab_size)

    def check_params(self, params: SamplingParams) -> None:
        """BadInput unless ``params``' token ids are this model's (ids in ``logit_bias``)."""
        rules.check_param_ids(params, self.runner.config.vocab_size)

    def add_request(self, request_id: str, prompt: list[int] | EngineRequest,
                    params: SamplingParams | None = None,
                    reservation: Reservation | None = None) -> None:
        """Admit a request: ``prompt`` is its token ids, checked here with ``params``
        (``check_request``), or an ``EngineRequest`` already checked. Without a
        ``reservation``, reserve ``prompt + cap`` here (pinning the cached blocks its prompt
        begins with) or raise AdmissionRejected now, no line (``LLM`` and the server admit
        through ``Admission``); a given one must be for this prompt (``check_reservation``).

        From this call on the engine owns the reservation: it releases it at once if it
        refuses the request, else when the request finishes or is aborted."""
        try:
            request = prompt
            if not isinstance(request, EngineRequest):
                request = self.check_request(prompt, params)
            if reservation is None:
                reservation = self._reserve(request)
            else:
                rules.check_reservation(reservation, request,
                                        self.ledger.blocks_for(request.num_tokens))
            # A grammar's matcher() runs here: whatever it raises, the blocks go back.
            # Its priority is the one it runs at (``order.run_priority``: 0 under fcfs).
            seq = Sequence.start(request_id, request, reservation, self.tokenizer,
                                 self.runner.device, request.priority)
            self.intake.add(seq)
        except BaseException:
            if reservation is not None:
                self.ledger.release(reservation)
            raise

    def _reserve(self, request: EngineRequest) -> Reservation:
        tokens, ids = request.num_tokens, request.prompt_token_ids
        use_cached = request.uses_cached_blocks
        salt = request.lora_salt
        reservation = self.ledger.try_reserve(tokens, ids, use_cached=use_cached, salt=salt,
                                              adapter=request.lora)
        if reservation is None:
            needed = self.ledger.blocks_needed(tokens, 1, ids, use_cached=use_cached, salt=salt)
            safety = self.ledger.overcommit
            raise AdmissionRejected(needed, self.ledger.free_blocks, safety and safety.refusal)
        return reservation

    def abort_request(self, request_id: str) -> None:
        """Stop a request; idempotent (``Intake.abort``): the next step reports it with
        ``finish_reason == "abort"``."""
        self.intake.abort(request_id)

    def abort_all(self) -> None:
        """Finish every request the engine holds as aborted and release its blocks now,
        without stepping (shutdown, an interrupted ``generate``, or after ``step()`` raised,
        whatever state it left the queues in). Call it only while no ``step()`` runs."""
        self.intake.abort_all()

    def has_unfinished_requests(self) -> bool:
        return self.intake.has_pending() or self.scheduler.has_unfinished()

    # -- the loop (one thread) --------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one engine iteration; return the requests that produced tokens or finished.

        A failure is contained to the requests it touches: an exception raised for one
        sequence (sampling, detokenizing, stop handling) finishes that sequence alone with
        ``finish_reason == "error"``; one raised by the batched forward pass (out of memory
        included) fails the requests of that step, empties the allocator's cache and lets
        the rest go on. Only ``MAX_CONSECUTIVE_FAILED_STEPS`` failed forward passes in a
        row raise ``EngineFailed``: then the engine itself is broken."""
        outputs = [request_output(seq, []) for seq in self.intake.take()]
        batch = self.scheduler.schedule()
        self.stall_watch.observe(not batch.is_empty, self.scheduler.has_unfinished(),
                                 self.scheduler.describe)
        if batch.is_empty:
            return outputs
        started = time.monotonic()
        try:
            step = self.runner.execute(batch)
        except EngineFailed:  # a tensor-parallel rank is gone (core/ranks.py): no retry
            raise
        except Exception as exc:
            return outputs + self._fail_step(batch, exc)
        if self.cpu_threads is not None:
            self.cpu_threads.after_step(time.monotonic() - started)
        self.consecutive_failed_steps = 0
        self._advance(batch, step)
        seqs = batch.sampled  # a prompt still partly computed gets no token yet
        sampled = sample_each(self.sampler, step.logits, seqs, self._shared_generator)
        return outputs + [self._postprocess(seq, s) for seq, s in zip(seqs, sampled, strict=True)]

    def _advance(self, batch: ScheduledBatch, step: StepOutput) -> None:
        """The step's K/V are in the cache: count them computed, let the choices waiting for
        a prompt their owner just finished pin it, and offer the filled blocks to the prefix
        cache, all before any sequence can finish and release."""
        for chunk in batch.prefills:
            seq = chunk.seq
            seq.num_computed_tokens += chunk.length
            self.num_prefill_tokens += chunk.length
            if seq.prompt_logprobs is not None:
                seq.prompt_logprobs += step.prompt_logprobs[seq.request_id]
            share = seq.reservation.share
            if (share is not None and share.owner is seq.reservation
                    and seq.num_computed_tokens >= share.end * self.ledger.block_size):
                self.ledger.share_prompt(seq.reservation)
        for seq in batch.decodes:
            seq.num_computed_tokens += 1
        if not self.ledger.prefix_cache.enabled:
            return
        block_size = self.ledger.block_size
        for seq in [chunk.seq for chunk in batch.prefills] + batch.decodes:
            if seq.num_computed_tokens // block_size > seq.reservation.num_registered_blocks:
                self.ledger.prefix_cache.register(seq.reservation, seq.token_ids, seq.num_computed_tokens)

    def _postprocess(self, seq: Sequence, sampled: Sampled | Exception) -> RequestOutput:
        """Append the sampled token, or fail this sequence alone on a fault of its own (logits
        that are not finite: the blocks it computed leave the prefix cache too)."""
        if isinstance(sampled, NonFiniteLogits):
            return self._fail(seq, "forward pass", sampled, traceback=False, uncache=True)
        if isinstance(sampled, Exception):
            return self._fail(seq, "sampling", sampled)
        token_id, logprobs = sampled
        written = len(seq.output_token_ids)
        try:
            self._append_token(seq, token_id, logprobs)
        except Exception as exc:
            return self._fail(seq, "postprocessing", exc)
        # A token refused at a dead end is not new: it was never written.
        return request_output(seq, seq.output_token_ids[written:])

    def _append_token(self, seq: Sequence, token_id: int, logprobs: TokenLogprobs | None) -> None:
        """Add the sampled token and finish the sequence if it stops here
        (``Sequence.append``). Raises when its grammar refuses the token (the caller fails
        this sequence alone)."""
        reason = seq.append(token_id, logprobs, self.tokenizer.eos_token_ids)
        if reason is not None:
            self._finish(seq, reason)

    # -- finishing ----------------------------------------------------------------------

    def _finish(self, seq: Sequence, reason: str, *, uncache: bool = False) -> None:
        self.scheduler.finish(seq, reason, uncache=uncache)
        self.intake.forget(seq.request_id)

    def _fail(self, seq: Sequence, stage: str, exc: BaseException, *,
              traceback: bool = True, uncache: bool = False) -> RequestOutput:
        """Finish one request with ``"error"``; its reservation goes back at once (the
        blocks it computed out of the prefix cache too, with ``uncache``)."""
        log.error("request %s failed in %s: %s: %s", seq.request_id, stage,
                  type(exc).__name__, exc, exc_info=exc if traceback else None)
        if not seq.is_finished:
            self._finish(seq, "error", uncache=uncache)
        output = request_output(seq, [])
        output.error = f"{stage} failed: {type(exc).__name__}: {exc}"
        return output

    def _fail_step(self, batch: ScheduledBatch, exc: Exception) -> list[RequestOutput]:
        """A failed forward pass: fail the requests it computed, free the allocator's cache."""
        self.consecutive_failed_steps += 1
        seqs = [chunk.seq for chunk in batch.prefills] + list(batch.decodes)
        log.error("forward pass failed (%d in a row) for %d requests: %s: %s",
                  self.consecutive_failed_steps, len(seqs), type(exc).__name__, exc,
                  exc_info=exc)
        outputs = [self._fail(seq, "forward pass", exc, traceback=False) for seq in seqs]
        exc = None  # drop the traceback's frames, which hold the step's tensors
        if self.runner.device.type == "cuda":
            torch.cuda.empty_cache()
        if self.consecutive_failed_steps >= MAX_CONSECUTIVE_FAILED_STEPS:
            raise EngineFailed(f"{self.consecutive_failed_steps} forward passes failed in a "
                               "row; the engine cannot make progress")
        return outputs
