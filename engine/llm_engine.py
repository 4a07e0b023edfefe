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

from kvledger.engine.budget.device import DeviceMemory, probe_device
from kvledger.engine.budget.plan import Measured, Plan, make_plan
from kvledger.engine.budget.report import render_report
from kvledger.engine.config import EngineConfig
from kvledger.engine.errors import AdmissionRejected, BadInput, DoesNotFit, PromptTooLong
from kvledger.engine.ledger import KVLedger, Reservation
from kvledger.engine.loader import load_model, weights_bytes
from kvledger.engine.model_config import ModelConfig
from kvledger.engine.model_runner import TORCH_DTYPES, ModelRunner
from kvledger.engine.outputs import RequestOutput
from kvledger.engine.sampler import Sampler
from kvledger.engine.sampling_params import SamplingParams
from kvledger.engine.scheduler import Scheduler
from kvledger.engine.sequence import Sequence
from kvledger.engine.tokenizer import Tokenizer

log = logging.getLogger("kvledger.engine")


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
        self.sampler = Sampler(config.seed, runner.device)
        self._lock = threading.Lock()
        self._pending_adds: dict[str, Sequence] = {}
        self._pending_aborts: list[str] = []
        self._aborted: list[Sequence] = []  # finished by abort, reported by the next step
        self._known_ids: set[str] = set()

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLMEngine:
        """Plan -> load weights -> profile -> re-plan with measured figures -> allocate
        the KV pool. Raises DoesNotFit (the same report as ``kvledger plan``) if either
        plan does not fit, BadInput for an unsupported or broken checkpoint."""
        model_config = ModelConfig.from_dir(config.model)  # refuses unsupported architectures
        device_memory = probe_device(config)  # before loading: free memory drops after
        plan = make_plan(config, device=device_memory)
        if not plan.fits:
            raise DoesNotFit(render_report(plan), plan)
        device = _torch_device(config.device)
        tokenizer = Tokenizer(config.model)
        model = load_model(config.model, model_config, TORCH_DTYPES[plan.model_dtype], device)
        runner = ModelRunner(model, device, plan.max_model_len, plan.kv.block_size)
        measured = Measured(
            weights_bytes=weights_bytes(model),
            activation_peak_bytes=runner.profile(plan.max_num_batched_tokens, plan.max_model_len,
                                                 plan.max_num_seqs, plan.kv.dtype),
            context_bytes=context_bytes(device, device_memory, config),
            cuda_graph_bytes=0,  # the engine runs eagerly: it captures no CUDA graphs
        )
        measured_plan = make_plan(config, device=device_memory, measured=measured)
        _log_predicted_vs_measured(plan, measured_plan)
        if not measured_plan.fits:
            raise DoesNotFit(render_report(measured_plan), measured_plan)
        kv = measured_plan.kv
        pool_bytes = runner.allocate_kv_cache(kv.num_blocks, kv.dtype)
        log.info("KV pool: %d blocks x %d tokens (%d bytes)", kv.num_blocks, kv.block_size, pool_bytes)
        return cls(config, measured_plan, tokenizer, runner, KVLedger(kv.num_blocks, kv.block_size))

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
        """Admit a request. Without a ``reservation``, reserve ``prompt + cap`` here and raise
        AdmissionRejected when the pool cannot hold it. The engine owns the reservation
        from now on and releases it when the request finishes or is aborted."""
        try:
            self.check_prompt(prompt_token_ids)
            cap = self.output_cap(len(prompt_token_ids), params)
            needed_blocks = self.ledger.blocks_for(len(prompt_token_ids) + cap)
            if reservation is not None and reservation.num_blocks < needed_blocks:
                raise BadInput(f"the reservation holds {reservation.num_blocks} blocks; prompt + "
                               f"cap needs {needed_blocks}")
        except BadInput:
            if reservation is not None:
                self.ledger.release(reservation)
            raise
        if reservation is None:
            reservation = self.ledger.try_reserve(len(prompt_token_ids) + cap)
            if reservation is None:
                raise AdmissionRejected(needed_blocks, self.ledger.free_blocks)
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.runner.device).manual_seed(params.seed)
        seq = Sequence(request_id, list(prompt_token_ids), params, cap, reservation,
                       self.tokenizer.detokenizer(prompt_token_ids), generator)
        with self._lock:  # check and claim the id in one step
            duplicate = request_id in self._known_ids
            if not duplicate:
                self._known_ids.add(request_id)
                self._pending_adds[request_id] = seq
        if duplicate:
            self.ledger.release(reservation)
            raise BadInput(f"request id {request_id!r} is already in use")

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
        """Run one engine iteration; return the requests that produced tokens or finished."""
        outputs = [self._output(seq, []) for seq in self._apply_pending()]
        batch = self.scheduler.schedule()
        if batch.is_empty:
            return outputs
        logits = self.runner.execute(batch)
        for chunk in batch.prefills:
            chunk.seq.num_computed_tokens += chunk.length
        for seq in batch.decodes:
            seq.num_computed_tokens += 1
        seqs = batch.sampled  # a prompt still partly computed gets no token yet
        token_ids = self.sampler(logits, seqs)
        for seq, token_id in zip(seqs, token_ids, strict=True):
            self._append_token(seq, token_id)
            outputs.append(self._output(seq, [token_id]))
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

    def _append_token(self, seq: Sequence, token_id: int) -> None:
        seq.output_token_ids.append(token_id)
        params = seq.params
        new_text = seq.detokenizer.add(token_id)
        seq.text += new_text
        reason = None
        stop_token = token_id in params.stop_token_ids or (
            not params.ignore_eos and token_id in self.tokenizer.eos_token_ids)
        if stop_token or (new_text and params.stop_strings
                          and self._cut_stop_string(seq, len(new_text))):
            reason = "stop"
        elif len(seq.output_token_ids) >= seq.max_tokens:
            reason = "length"
        if reason is not None:
            self.scheduler.finish(seq, reason)
            with self._lock:
                self._known_ids.discard(seq.request_id)

    @staticmethod
    def _cut_stop_string(seq: Sequence, new_chars: int) -> bool:
        """Cut the text at the first stop string that the new text completes."""
        longest = max(len(s) for s in seq.params.stop_strings)
        start = max(0, len(seq.text) - new_chars - longest + 1)
        hits = [i for i in (seq.text.find(s, start) for s in seq.params.stop_strings) if i >= 0]
        if not hits:
            return False
        seq.text = seq.text[:min(hits)]
        return True

    def _output(self, seq: Sequence, new_token_ids: list[int]) -> RequestOutput:
        text = seq.text
        if seq.params.stop_strings and not seq.is_finished:
            # Hold back what could be the start of a stop string, so streamed text never
            # shows characters that a later cut removes.
            held = max(len(s) for s in seq.params.stop_strings) - 1
            text = text[:max(0, len(text) - held)]
        return RequestOutput(seq.request_id, seq.prompt_token_ids, list(seq.output_token_ids),
                             new_token_ids, text, seq.is_finished, seq.finish_reason)

    def check_prompt(self, prompt_token_ids: list[int]) -> None:
        """BadInput unless the ids are a non-empty list of this model's token ids."""
        if not prompt_token_ids:
            raise BadInput("the prompt is empty")
        vocab = self.runner.config.vocab_size
        if not all(isinstance(t, int) and 0 <= t < vocab for t in prompt_token_ids):
            raise BadInput(f"prompt token ids must be integers in [0, {vocab})")


def _torch_device(flag: str) -> torch.device:
    if flag == "cuda" or (flag == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise BadInput("--device cuda, but torch sees no CUDA device (is this a CPU build of torch?)")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def context_bytes(device: torch.device, probed: DeviceMemory, config: EngineConfig) -> int | None:
    """Device memory this process took that torch's allocator does not hold (CUDA
    context, cuBLAS handles); None on the CPU, where the planner's estimate stands.

    The plan's limit is the memory free when ``probed`` was read, before this process
    touched the device, so memory already in use then (other processes; on a unified
    pool the OS and every host process) is outside the budget and must not count
    again: the context is the drop in free memory since the probe, read the same way
    (NVML, or host memory on a unified pool), less what the allocator reserves. Only a
    what-if device, which has no such reading, falls back to ``total - free - reserved``
    from ``cudaMemGetInfo``."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    reserved = torch.cuda.memory_reserved(device)
    if probed.kind == "cuda":
        now = probe_device(config)
        if now.kind == "cuda":
            return max(0, probed.free_bytes - now.free_bytes - reserved)
    free, total = torch.cuda.mem_get_info(device)
    return max(0, total - free - reserved)


def _log_predicted_vs_measured(predicted: Plan, measured: Plan) -> None:
    for name, before in predicted.classes.items():
        after = measured.classes[name]
        source = "measured" if name in measured.measured else "estimated"
        log.info("memory %-11s predicted %12d  %s %12d  (%+d)", name, before, source, after,
                 after - before)
