"""One request's state inside the engine: its tokens, its reservation, where it stands."""

from __future__ import annotations

import enum

import torch

from kvledger.engine.admission.order import ANONYMOUS, Place
from kvledger.engine.core.request import EngineRequest
from kvledger.engine.kv.reservation import Reservation
from kvledger.engine.model.detokenizer import IncrementalDetokenizer
from kvledger.engine.model.tokenizer import Tokenizer
from kvledger.engine.sampling.bad_words import BadWordsMatcher
from kvledger.engine.sampling.logprobs import TokenLogprobs
from kvledger.engine.sampling.params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"     # admitted (blocks reserved), not scheduled yet
    RUNNING = "running"     # prefilling its prompt chunk by chunk, then decoding
    FINISHED = "finished"   # reservation released


class Sequence:
    """A request from admission to finish. ``max_tokens`` is its output cap: the
    reservation holds ``prompt + max_tokens`` tokens, so decoding never runs out of KV.

    ``logprobs`` and ``prompt_logprobs`` are lists only when the request asked for them
    (None otherwise, so a request that did not ask carries nothing); ``matcher`` is its
    grammar's state, when it has a grammar; ``bad_words_matcher`` its bad words', when it
    has them."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 max_tokens: int, reservation: Reservation, detokenizer: IncrementalDetokenizer,
                 generator: torch.Generator | None) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.output_token_ids: list[int] = []
        self.params = params
        self.max_tokens = max_tokens
        self.reservation = reservation
        self.detokenizer = detokenizer
        self.generator = generator
        # Tokens whose K/V are in the cache: from the start, the prefix its reservation
        # found cached (none for a sequence only sampled from, without a reservation).
        self.num_computed_tokens = 0 if reservation is None else reservation.num_cached_tokens
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        # vLLM's: the stop string or stop token id that ended it (None: EOS, or another reason)
        self.stop_reason: str | int | None = None
        self.text = ""  # the output text so far, stop strings cut off
        self.logprobs: list[TokenLogprobs] | None = None if params.logprobs is None else []
        self.prompt_logprobs: list[TokenLogprobs | None] | None = (
            None if params.prompt_logprobs is None else [])
        self.matcher = None if params.grammar is None else params.grammar.matcher()
        # Which of its bad words the output has begun, read token by token (bad_words.py).
        self.bad_words_matcher = None if not params.bad_words_token_ids else BadWordsMatcher(
            params.bad_words_token_ids, params.allowed_token_ids)
        self.penalty_counts = None  # its output's token counts, when it has penalties (sampler)
        self.lora = None  # its LoRA adapter (engine/model/lora_adapter.py), None: the base
        self.priority = 0  # its request's (lower is seated sooner; admission/headroom.py)
        self.tenant = ANONYMOUS  # its request's: its share of seats and prompt tokens
        self.place: Place | None = None  # its place in the line for a seat, while it waits

    @classmethod
    def start(cls, request_id: str, request: EngineRequest, reservation: Reservation,
              tokenizer: Tokenizer, device: torch.device | str, priority: int) -> Sequence:
        """``request`` as the engine runs it: its detokenizer, its own generator when
        seeded, its adapter and ``priority``. A grammar's ``matcher()`` runs here."""
        ids, params = request.prompt_token_ids, request.params
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=device).manual_seed(params.seed)
        seq = cls(request_id, list(ids), params, request.cap_tokens, reservation,
                  tokenizer.detokenizer(ids, params.kept_special_ids, params.skip_special_tokens,
                                        params.spaces_between_special_tokens), generator)
        seq.lora, seq.priority, seq.tenant = request.lora, priority, request.tenant
        return seq

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def token_ids(self) -> list[int]:
        """Prompt and output tokens, as a new list."""
        return self.prompt_token_ids + self.output_token_ids

    @property
    def prompt_computed(self) -> bool:
        return self.num_computed_tokens >= len(self.prompt_token_ids)

    @property
    def last_token_id(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    @property
    def block_ids(self) -> list[int]:
        return self.reservation.block_ids

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def allowed_index(self, device: torch.device) -> torch.Tensor:
        """Its ``allowed_token_ids`` as an index on ``device``, built once for its request
        and shared by its choices (``AllowedTokenIds.index``): up to a vocabulary's worth of
        ids (13 ms to build from a list of 262,144), which every step, and every choice,
        would otherwise pay for everyone in the batch."""
        return self.params.allowed_token_ids.index(device)

    def append(self, token_id: int, logprobs: TokenLogprobs | None,
               eos_token_ids: set[int]) -> str | None:
        """Add a sampled token, its text and logprobs; the reason it finishes here
        (``stop``, ``length``, ``grammar``), else None. ValueError when its grammar refuses
        the token. vLLM's rules: before ``min_tokens`` no stop token or string ends it; the
        token that stops it (EOS, a stop token id) is not detokenized into its text unless
        ``include_stop_str_in_output``, and a stop token id (not EOS) is its
        ``stop_reason``. At a dead end (its grammar's, or its bad words took out every one
        of its allowed tokens) the token is not added and it finishes with ``grammar``."""
        if self.bad_words_matcher is not None and self.bad_words_matcher.dead_end:
            return "grammar"  # the token was drawn from outside its allowed ones: not written
        if self.matcher is not None and not self.matcher.accept(token_id):
            if self.matcher.dead_end:  # nothing could follow: the output ends here
                return "grammar"
            raise ValueError(f"the grammar does not allow token {token_id} here")
        self.output_token_ids.append(token_id)
        if self.logprobs is not None:
            self.logprobs.append(logprobs)
        params = self.params
        checks_stops = len(self.output_token_ids) >= params.min_tokens
        eos = not params.ignore_eos and token_id in eos_token_ids
        stop_token = checks_stops and (eos or token_id in params.stop_token_set)
        if stop_token and not eos:
            self.stop_reason = token_id
        keep = not stop_token or params.include_stop_str_in_output
        new_text = self.detokenizer.add(token_id) if keep else ""
        self.text += new_text
        if stop_token or (self.matcher is not None and self.matcher.is_terminated) or (
                checks_stops and new_text and params.stop_strings
                and self.cut_stop_string(len(new_text))):
            return "stop"
        if len(self.output_token_ids) >= self.max_tokens:
            return "length"
        return None

    def cut_stop_string(self, new_chars: int) -> bool:
        """Cut the text at the first stop string that the ``new_chars`` last characters
        complete. Only those and the ``longest - 1`` before them are searched, so a token
        costs the same however long the text has grown."""
        params = self.params
        start = max(0, len(self.text) - new_chars - params.longest_stop + 1)
        hits = [(i, len(s), s) for s in params.stop_strings
                if (i := self.text.find(s, start)) >= 0]
        if not hits:
            return False
        at, length, self.stop_reason = min(hits)
        self.text = self.text[:at + length if params.include_stop_str_in_output else at]
        return True
