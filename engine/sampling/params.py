"""Per-request sampling settings (vLLM's names and defaults); ``StructuredOutputsParams``
is importable from here, as from vLLM's ``sampling_params``."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from kvledger.engine.errors import BadInput
from kvledger.engine.sampling.allowed_tokens import AllowedTokenIds
from kvledger.engine.sampling.bad_words import BadWordSequences
from kvledger.engine.sampling.structured_params import StructuredOutputsParams
from kvledger.engine.settings.config_values import MAX_LOGPROBS  # the engine's bound, serve's too

GREEDY_BELOW_TEMPERATURE = 1e-5  # vLLM's _SAMPLING_EPS
MAX_LOGIT_BIAS_VALUE = 100.0     # OpenAI's bound on a logit_bias value (either sign)
MAX_PENALTY = 2.0                # OpenAI's bound on presence and frequency penalties


def _number(name: str, value: Any, low: float, high: float) -> float:
    """``value`` if it is a (non-bool) number in ``[low, high]``, else BadInput naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise BadInput(f"{name} must be a number in [{low:g}, {high:g}], got {value!r}")
    return float(value)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass
class SamplingParams:
    """How one request picks its tokens and when it stops.

    ``temperature == 0`` (or below 1e-5) is greedy. ``max_tokens=None`` means "up to the context limit".
    Stop strings are cut from the returned text (kept with ``include_stop_str_in_output``);
    stop token ids and EOS end the request with ``finish_reason == "stop"`` (the token is
    kept in ``token_ids``). ``top_k`` -1 or 0 is off. A sampled token is drawn, as vLLM
    draws it, from the logits divided by ``temperature``, less the tokens whose probability
    is under ``min_p`` times the top one's, then ``top_k``, then ``top_p``.

    Logits processing, in vLLM's order, for the requests that ask: ``logit_bias`` added,
    ``repetition_penalty`` (over prompt and output: a seen token's logit divided by it
    when positive, multiplied when negative), ``frequency_penalty`` and
    ``presence_penalty`` (over the output: ``logit -= frequency * count + presence *
    (count > 0)``), the ``grammar``'s mask, then EOS and stop token ids masked out until
    ``min_tokens`` tokens are out (stop strings are not checked before either). Greedy
    requests take the argmax of the processed logits.

    ``logprobs=k`` reports each generated token's logprob and rank and the k most likely
    tokens; ``prompt_logprobs=k`` the same for each prompt token. Both come from the
    model's raw logits, before any processing (vLLM's default ``raw_logprobs``).

    ``grammar``: a compiled grammar whose ``matcher()`` gives each sequence a matcher with
    ``fill_mask(logits_row)``, ``accept(token_id) -> bool``, ``is_terminated`` and
    ``dead_end``. A terminated matcher finishes the request with "stop"; a token refused at
    a dead end (the mask allowed nothing) with "grammar"; any other refused token fails it.

    ``allowed_token_ids`` beside ``bad_words``: never a token outside the allowed ones. When
    one-token bad words are every allowed id, the request is refused (BadInput); when at
    some step the bad words that the output has begun take out every allowed id, the
    request finishes there with "grammar", as at a grammar's dead end.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    logit_bias: dict[int, float] | None = None
    # vLLM's: the only tokens it may sample (its own row's logits selected; None: all),
    # kept as ``AllowedTokenIds``
    allowed_token_ids: tuple[int, ...] | None = None
    # vLLM's: words never written; their token sequences (``bad_words.word_sequences``)
    # are found with the tokenizer at the engine's door, kept as ``BadWordSequences``
    bad_words: tuple[str, ...] | None = None
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True  # False: special tokens' text stays in the output
    # False (with skip_special_tokens False): an added token right after another is its
    # bare text, never spaced from it by the tokenizer's decoder (vLLM's field)
    spaces_between_special_tokens: bool = True
    grammar: Any = None
    # vLLM's offline constraint (``structured_params.StructuredOutputsParams``): compiled
    # at the engine's door into ``grammar``
    structured_outputs: StructuredOutputsParams | None = None
    # Special tokens whose text the output keeps (decoding drops the others): a tool-call
    # format's markers, such as Mistral's [TOOL_CALLS], which its parser must see.
    kept_special_ids: frozenset[int] = frozenset()
    stop_strings: tuple[str, ...] = field(init=False, repr=False, default=())
    # Derived once, so the per-token checks cost the same however long the output grows.
    longest_stop: int = field(init=False, repr=False, default=0)
    stop_token_set: frozenset[int] = field(init=False, repr=False, default=frozenset())
    has_penalties: bool = field(init=False, repr=False, default=False)
    # Whether the sampler must touch this request's logits (min_tokens aside: it stops
    # mattering once reached).
    processes_logits: bool = field(init=False, repr=False, default=False)

    def __post_init__(self) -> None:
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, int | float):
            raise BadInput(f"temperature must be a number, got {self.temperature!r}")
        if not self.temperature >= 0.0:  # also refuses NaN
            raise BadInput(f"temperature must be >= 0, got {self.temperature}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, int | float) \
                or not 0.0 < self.top_p <= 1.0:
            raise BadInput(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise BadInput(f"top_k must be -1 or 0 (off) or a positive integer, got {self.top_k!r}")
        self.min_p = _number("min_p", self.min_p, 0.0, 1.0)
        if self.seed is not None and (not _is_int(self.seed)
                                      or not -2**63 <= self.seed < 2**64):  # torch.Generator's range
            raise BadInput(f"seed must be a 64-bit integer, got {self.seed!r}")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise BadInput(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        stop = [self.stop] if isinstance(self.stop, str) else self.stop or []
        if not isinstance(stop, list | tuple) or not all(isinstance(s, str) and s for s in stop):
            raise BadInput("stop must be a non-empty string or a list of non-empty strings")
        self.stop_strings = tuple(stop)
        self.longest_stop = max((len(s) for s in stop), default=0)
        ids = self.stop_token_ids or []
        if not isinstance(ids, list | tuple) or not all(_is_int(t) and t >= 0 for t in ids):
            raise BadInput("stop_token_ids must be a list of non-negative integers")
        self.stop_token_ids = list(ids)
        self.stop_token_set = frozenset(ids)
        kept = self.kept_special_ids
        if not isinstance(kept, set | frozenset | list | tuple) or not all(
                _is_int(t) and t >= 0 for t in kept):
            raise BadInput("kept_special_ids must be a set of non-negative token ids")
        self.kept_special_ids = frozenset(kept)
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens",
                     "spaces_between_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise BadInput(f"{name} must be true or false, got {getattr(self, name)!r}")
        self._check_processing()
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and (not _is_int(k) or not 0 <= k <= MAX_LOGPROBS):
                raise BadInput(f"{name} must be an integer in [0, {MAX_LOGPROBS}], got {k!r}")

    def _check_processing(self) -> None:
        bound = MAX_PENALTY
        self.presence_penalty = _number("presence_penalty", self.presence_penalty, -bound, bound)
        self.frequency_penalty = _number("frequency_penalty", self.frequency_penalty, -bound, bound)
        p = self.repetition_penalty
        if isinstance(p, bool) or not isinstance(p, int | float) or not (p > 0 and math.isfinite(p)):
            raise BadInput(f"repetition_penalty must be a finite number > 0, got {p!r}")
        self.repetition_penalty = float(p)
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise BadInput(f"min_tokens must be a non-negative integer, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise BadInput(f"min_tokens ({self.min_tokens}) must be at most max_tokens "
                           f"({self.max_tokens})")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict) or not all(
                    _is_int(t) and t >= 0 for t in self.logit_bias):
                raise BadInput("logit_bias must map non-negative token ids to numbers")
            self.logit_bias = {t: _number(f"logit_bias[{t}]", v, -MAX_LOGIT_BIAS_VALUE,
                                          MAX_LOGIT_BIAS_VALUE)
                               for t, v in self.logit_bias.items()}
        # Checked once per request: its choices' params (a ``replace`` of these) carry the
        # same objects, which are not sorted nor their tables built again (sorting 149,000
        # allowed ids again took 19 ms a choice, 2.4 s for 128 choices).
        if self.allowed_token_ids is not None and not isinstance(self.allowed_token_ids,
                                                                 AllowedTokenIds):
            self.allowed_token_ids = AllowedTokenIds(self.allowed_token_ids)
        if self.bad_words is not None:
            if not isinstance(self.bad_words, list | tuple) or not all(
                    isinstance(w, str) and w.strip() for w in self.bad_words):
                raise BadInput("bad_words must be a list of words, none empty")
            self.bad_words = tuple(self.bad_words)
        if self.bad_words_token_ids and not isinstance(self.bad_words_token_ids,
                                                       BadWordSequences):
            self.bad_words_token_ids = BadWordSequences(self.bad_words_token_ids)
        if self.bad_words_token_ids and self.allowed_token_ids is not None and \
                self.allowed_token_ids.all_in(self.bad_words_token_ids.single_tokens):
            raise BadInput("bad_words ban every one of allowed_token_ids: no token is left "
                           "to write", "bad_words")
        if self.grammar is not None and not callable(getattr(self.grammar, "matcher", None)):
            raise BadInput("grammar must be a compiled grammar with a matcher() method")
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise BadInput("structured_outputs must be a StructuredOutputsParams")
            if self.grammar is not None:
                raise BadInput("give structured_outputs or a compiled grammar, not both")
        self.has_penalties = (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                              or self.repetition_penalty != 1.0)
        self.processes_logits = bool(self.has_penalties or self.logit_bias
                                     or self.allowed_token_ids or self.bad_words_token_ids
                                     or self.grammar is not None)

    def summary(self) -> str:
        """How it samples, in one line (a request log's; never its stop strings' text)."""
        return (f"temperature {self.temperature:g}, top_p {self.top_p:g}, top_k {self.top_k}, "
                f"min_p {self.min_p:g}, repetition_penalty {self.repetition_penalty:g}, "
                f"presence_penalty {self.presence_penalty:g}, frequency_penalty "
                f"{self.frequency_penalty:g}, seed {self.seed}, {len(self.stop_strings)} stop "
                f"strings, logprobs {self.logprobs}, grammar {self.grammar is not None}")

    @property
    def greedy(self) -> bool:
        # vLLM's rule: a temperature this small is greedy; dividing the logits by it
        # (1e-300) would overflow to inf and the softmax to NaN. top_k 0 and -1 are off.
        return self.temperature < GREEDY_BELOW_TEMPERATURE or self.top_k == 1


__all__ = ["SamplingParams", "StructuredOutputsParams"]
