"""The engine loop: admit requests against the KV ledger, then ``step()`` =
schedule -> run the model -> sample -> postprocess.

``add_request`` and ``abort_request`` may be called from any thread while ``step()`` runs
in another: they are queued under a lock and applied at the start of the next step,
aborts first, so freed blocks are back before anything new is scheduled.
"""

from __future__ import annotations

import logging
import threading

import torch

from kvledger.engine.config import EngineConfig
from kvledger.engine.core.outputs import RequestOutput, TokenLogprobs
from kvledger.engine.core.scheduler import ScheduledBatch, Scheduler
from kvledger.engine.core.sequence import Sequence
from kvledger.engine.errors import AdmissionRejected, BadInput, PromptTooLong
from kvledger.engine.kv.ledger import KVLedger, Reservation
from kvledger.engine.model.runner import ModelRunner
from kvledger.engine.model.tokenizer import Tokenizer
from kvledger.engine.planner.plan import Plan
from kvledger.engine.sampling.params import SamplingParams
from kvledger.engine.sampling.sampler import Sampler

log = logging.getLogger("kvledger.engine")

# Failed forward passes in a row after which the engine is broken, not unlucky: one
# out-of-memory fails its step's requests, three in a row (each after emptying the
# allocator's cache) mean the device cannot run even a smaller step.
MAX_CONSECUTIVE_FAILED_STEPS = 3


class EngineFailed(RuntimeError):
    """The engine cannot make progress (see ``MAX_CONSECUTIVE_FAILED_STEPS``)."""


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
        self.scheduler = Scheduler(ledger, plan.max_num_seqs, plan.max_num_batched_tokens)
        self.sampler = Sampler(config.seed, runner.device, tokenizer.eos_token_ids)
        self._shared_generator = self.sampler.generator  # unseeded rows draw from it
        self._lock = threading.Lock()
        self._pending_adds: dict[str, Sequence] = {}
        self._pending_aborts: list[str] = []
        self._aborted: list[Sequence] = []  # finished by abort, reported by the next step
        self._known_ids: set[str] = set()
        self.consecutive_failed_steps = 0
        self.num_prefill_tokens = 0  # prompt tokens computed (not those found in the cache)

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLMEngine:
        """Plan -> load weights -> profile -> re-plan with measured figures -> allocate
        the KV pool (``startup.build``). Raises DoesNotFit (the same report as ``kvledger
        plan``) if either plan does not fit, BadInput for an unsupported or broken
        checkpoint."""
        from kvledger.engine.core.startup import build

        return cls(config, *build(config))

    # -- admission (any thread) -------------------------------------------------------

    def output_cap(self, num_prompt_tokens: int, params: SamplingParams) -> int:
        """The most tokens the request may generate; what its reservation covers."""
        if num_prompt_tokens >= self.max_model_len:
            raise PromptTooLong(f"the prompt has {num_prompt_tokens} tokens; the context limit is "
                                f"{self.max_model_len}, which must also hold at least one output token")
        room = self.max_model_len - num_prompt_tokens
        if params.max_tokens is None:
            return room
        if params.max_tokens > room:
            raise BadInput(f"max_tokens {params.max_tokens} + {num_prompt_tokens} prompt tokens exceed "
                           f"the context limit of {self.max_model_len}")
        return params.max_tokens

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    reservation: Reservation | None = None) -> None:
        """Admit a request. Without a ``reservation``, reserve ``prompt + cap`` here (pinning
        the cached blocks its prompt begins with) and raise AdmissionRejected when the pool
        cannot hold it. A given reservation must have been made for this prompt, and
        without cached blocks when the request asks for ``prompt_logprobs``. The engine
        owns the reservation from now on and releases it when the request finishes or is
        aborted."""
        # Prompt logprobs need every prompt position computed: no cached blocks.
        use_cached = params.prompt_logprobs is None
        try:
            self.check_prompt(prompt_token_ids)
            self.check_params(params)
            cap = self.output_cap(len(prompt_token_ids), params)
            needed_blocks = self.ledger.blocks_for(len(prompt_token_ids) + cap)
            if reservation is not None:
                self._check_reservation(reservation, prompt_token_ids, needed_blocks, use_cached)
        except BadInput:
            if reservation is not None:
                self.ledger.release(reservation)
            raise
        if reservation is None:
            tokens = len(prompt_token_ids) + cap
            reservation = self.ledger.try_reserve(tokens, prompt_token_ids, use_cached=use_cached)
            if reservation is None:
                needed = self.ledger.blocks_needed(tokens, 1, prompt_token_ids, use_cached=use_cached)
                raise AdmissionRejected(needed, self.ledger.free_blocks)
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.runner.device).manual_seed(params.seed)
        try:  # a grammar's matcher() runs here: whatever it raises, the blocks go back
            seq = Sequence(request_id, list(prompt_token_ids), params, cap, reservation,
                           self.tokenizer.detokenizer(prompt_token_ids), generator)
        except BaseException:
            self.ledger.release(reservation)
            raise
        with self._lock:  # check and claim the id in one step
            duplicate = request_id in self._known_ids
            if not duplicate:
                self._known_ids.add(request_id)
                self._pending_adds[request_id] = seq
        if duplicate:
            self.ledger.release(reservation)
            raise BadInput(f"request id {request_id!r} is already in use")

    @staticmethod
    def _check_reservation(reservation: Reservation, prompt_token_ids: list[int],
                           needed_blocks: int, use_cached: bool) -> None:
        if reservation.num_blocks < needed_blocks:
            raise BadInput(f"the reservation holds {reservation.num_blocks} blocks; prompt + "
                           f"cap needs {needed_blocks}")
        # Its cached blocks and keys were found from the prompt it was made for.
        if (reservation.prompt_token_ids is not None
                and list(reservation.prompt_token_ids) != list(prompt_token_ids)):
            raise BadInput("the reservation was made for another prompt")
        if reservation.num_cached_blocks and not use_cached:
            raise BadInput("a request with prompt_logprobs needs every prompt position computed; "
                           "its reservation must not use cached blocks")

    def abort_request(self, request_id: str) -> None:
        """Stop a request; idempotent. A request not yet picked up is released at once;
        a running one at the start of the next step. Either way the next step reports
        it with ``finish_reason == "abort"``."""
        with self._lock:
            seq = self._pending_adds.pop(request_id, None)
            if seq is not None:
                self.scheduler.finish(seq, "abort")  # only releases: it never reached the queues
                self._aborted.append(seq)
            elif request_id in self._known_ids:
                self._pending_aborts.append(request_id)

    def abort_all(self) -> None:
        """Finish every request as aborted and release its blocks now, without stepping
        (shutdown, an interrupted ``generate``, or after ``step()`` raised). Call it only
        while no ``step()`` is running."""
        with self._lock:
            pending = list(self._pending_adds.values())
            self._pending_adds.clear()
            self._pending_aborts.clear()
            self._aborted.clear()
            self._known_ids.clear()
        live = pending + list(self.scheduler.waiting) + list(self.scheduler.running.values())
        self.scheduler.waiting.clear()
        for seq in live:
            self.scheduler.finish(seq, "abort")

    def has_unfinished_requests(self) -> bool:
        with self._lock:
            pending = bool(self._pending_adds or self._pending_aborts or self._aborted)
        return pending or self.scheduler.has_unfinished()

    # -- the loop (one thread) --------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one engine iteration; return the requests that produced tokens or finished.

        A failure is contained to the requests it touches: an exception raised for one
        sequence (sampling, detokenizing, stop handling) finishes that sequence alone with
        ``finish_reason == "error"``; one raised by the batched forward pass (out of memory
        included) fails the requests of that step, empties the allocator's cache and lets
        the rest go on. Only ``MAX_CONSECUTIVE_FAILED_STEPS`` failed forward passes in a
        row raise ``EngineFailed``: then the engine itself is broken."""
        outputs = [self._output(seq, []) for seq in self._apply_pending()]
        batch = self.scheduler.schedule()
        if batch.is_empty:
            return outputs
        try:
            step = self.runner.execute(batch)
        except Exception as exc:
            return outputs + self._fail_step(batch, exc)
        self.consecutive_failed_steps = 0
        for chunk in batch.prefills:
            chunk.seq.num_computed_tokens += chunk.length
            self.num_prefill_tokens += chunk.length
            if chunk.seq.prompt_logprobs is not None:
                chunk.seq.prompt_logprobs += step.prompt_logprobs[chunk.seq.request_id]
            share = chunk.seq.reservation.share
            if (share is not None and share.owner is chunk.seq.reservation
                    and chunk.seq.num_computed_tokens >= share.end * self.ledger.block_size):
                self.ledger.share_prompt(chunk.seq.reservation)  # before it can finish
        for seq in batch.decodes:
            seq.num_computed_tokens += 1
        if self.ledger.enable_prefix_caching:  # before any of them finishes and releases
            self._register_computed_blocks([c.seq for c in batch.prefills] + batch.decodes)
        seqs = batch.sampled  # a prompt still partly computed gets no token yet
        for seq, sampled in zip(seqs, self._sample(step.logits, seqs), strict=True):
            if isinstance(sampled, Exception):
                outputs.append(self._fail(seq, "sampling", sampled))
                continue
            token_id, logprobs = sampled
            try:
                self._append_token(seq, token_id, logprobs)
            except Exception as exc:
                outputs.append(self._fail(seq, "postprocessing", exc))
                continue
            outputs.append(self._output(seq, [token_id]))
        return outputs

    def _register_computed_blocks(self, seqs: list[Sequence]) -> None:
        """Offer the blocks this step filled to the prefix cache."""
        block_size = self.ledger.block_size
        for seq in seqs:
            if seq.num_computed_tokens // block_size > seq.reservation.num_registered_blocks:
                self.ledger.register(seq.reservation, seq.token_ids, seq.num_computed_tokens)

    def _sample(self, logits: torch.Tensor,
                seqs: list[Sequence]) -> list[tuple[int, TokenLogprobs | None] | Exception]:
        """The batch's tokens, with their logprobs where asked; when the batched call
        fails, each row alone, so a fault belongs to the sequence that raised it (its
        entry is the exception)."""
        # The batched call may fail after some rows drew: their generators go back to
        # where they stood, so each row alone draws what it would have in the batch and a
        # seeded request never notices the fault of another.
        states = self._generator_states(seqs)
        try:
            out = self.sampler(logits, seqs)
            return [(token_id, out.logprobs.get(row)) for row, token_id in enumerate(out.token_ids)]
        except Exception:
            for generator, state in states:
                generator.set_state(state)
        tokens: list[tuple[int, TokenLogprobs | None] | Exception] = []
        for row, seq in enumerate(seqs):
            try:
                out = self.sampler(logits[row:row + 1], [seq])
                tokens.append((out.token_ids[0], out.logprobs.get(0)))
            except Exception as exc:
                tokens.append(exc)
        return tokens

    def _generator_states(self, seqs: list[Sequence]) -> list[tuple[torch.Generator, torch.Tensor]]:
        """The state of every generator the sampled (not greedy) rows draw from."""
        generators = {id(g): g for seq in seqs if not seq.params.greedy
                      for g in (seq.generator or self._shared_generator,)}
        return [(g, g.get_state()) for g in generators.values()]

    def _fail(self, seq: Sequence, stage: str, exc: BaseException, *,
              traceback: bool = True) -> RequestOutput:
        """Finish one request with ``"error"``; its reservation goes back at once."""
        log.error("request %s failed in %s: %s: %s", seq.request_id, stage,
                  type(exc).__name__, exc, exc_info=exc if traceback else None)
        if not seq.is_finished:
            self.scheduler.finish(seq, "error")
        with self._lock:
            self._known_ids.discard(seq.request_id)
        output = self._output(seq, [])
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

    def _apply_pending(self) -> list[Sequence]:
        with self._lock:
            aborts, self._pending_aborts = self._pending_aborts, []
            adds, self._pending_adds = list(self._pending_adds.values()), {}
            aborted, self._aborted = self._aborted, []
        for request_id in aborts:
            seq = self.scheduler.abort(request_id)
            if seq is not None:
                aborted.append(seq)
        for seq in adds:
            self.scheduler.add(seq)
        with self._lock:
            self._known_ids.difference_update(seq.request_id for seq in aborted)
        return aborted

    def _append_token(self, seq: Sequence, token_id: int, logprobs: TokenLogprobs | None) -> None:
        """Add the sampled token and finish the sequence if it stops here. Raises when its
        grammar refuses the token (the caller fails this sequence alone)."""
        if seq.matcher is not None and not seq.matcher.accept(token_id):
            if seq.matcher.dead_end:  # nothing could follow: the output ends here
                self._finish(seq, "grammar")
                return
            raise ValueError(f"the grammar does not allow token {token_id} here")
        seq.output_token_ids.append(token_id)
        if seq.logprobs is not None:
            seq.logprobs.append(logprobs)
        params = seq.params
        new_text = seq.detokenizer.add(token_id)
        seq.text += new_text
        reason = None
        # vLLM's rule: before min_tokens, no stop token or string ends the request.
        checks_stops = len(seq.output_token_ids) >= params.min_tokens
        stop_token = checks_stops and (token_id in params.stop_token_set or (
            not params.ignore_eos and token_id in self.tokenizer.eos_token_ids))
        if stop_token or (seq.matcher is not None and seq.matcher.is_terminated) or (
                checks_stops and new_text and params.stop_strings
                and self._cut_stop_string(seq, len(new_text))):
            reason = "stop"
        elif len(seq.output_token_ids) >= seq.max_tokens:
            reason = "length"
        if reason is not None:
            self._finish(seq, reason)

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.scheduler.finish(seq, reason)
        with self._lock:
            self._known_ids.discard(seq.request_id)

    @staticmethod
    def _cut_stop_string(seq: Sequence, new_chars: int) -> bool:
        """Cut the text at the first stop string that the new text completes. Only the
        new characters and the ``longest - 1`` before them are searched, so a token costs
        the same however long the text has grown."""
        params = seq.params
        start = max(0, len(seq.text) - new_chars - params.longest_stop + 1)
        hits = [(i, len(s)) for s in params.stop_strings if (i := seq.text.find(s, start)) >= 0]
        if not hits:
            return False
        at, length = min(hits)
        seq.text = seq.text[:at + length if params.include_stop_str_in_output else at]
        return True

    def _output(self, seq: Sequence, new_token_ids: list[int]) -> RequestOutput:
        text = seq.text
        if seq.params.stop_strings and not seq.is_finished:
            # Hold back what could be the start of a stop string, so streamed text never
            # shows characters that a later cut removes.
            text = text[:max(0, len(text) - seq.params.longest_stop + 1)]
        output = RequestOutput(seq.request_id, seq.prompt_token_ids, list(seq.output_token_ids),
                               new_token_ids, text, seq.is_finished, seq.finish_reason)
        if seq.logprobs is not None:
            output.logprobs = list(seq.logprobs)
        if seq.prompt_logprobs is not None and seq.prompt_computed:
            output.prompt_logprobs = seq.prompt_logprobs  # complete: it never changes again
        return output

    def check_params(self, params: SamplingParams) -> None:
        """BadInput unless ``params``' token ids are this model's (ids in ``logit_bias``)."""
        vocab = self.runner.config.vocab_size
        if params.logit_bias and max(params.logit_bias) >= vocab:
            raise BadInput(f"logit_bias token ids must be in [0, {vocab}), got {max(params.logit_bias)}")

    def check_prompt(self, prompt_token_ids: list[int]) -> None:
        """BadInput unless the ids are a non-empty list of this model's token ids."""
        if not prompt_token_ids:
            raise BadInput("the prompt is empty")
        vocab = self.runner.config.vocab_size
        if not all(isinstance(t, int) and 0 <= t < vocab for t in prompt_token_ids):
            raise BadInput(f"prompt token ids must be integers in [0, {vocab})")
