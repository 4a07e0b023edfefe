"""Per-request sampling settings (vLLM's names and defaults)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvledger.engine.errors import BadInput

GREEDY_BELOW_TEMPERATURE = 1e-5  # vLLM's _SAMPLING_EPS


@dataclass
class SamplingParams:
    """How one request picks its tokens and when it stops.

    ``temperature == 0`` (or below 1e-5) is greedy. ``max_tokens=None`` means "up to the context limit".
    Stop strings are cut from the returned text; stop token ids and EOS end the request
    with ``finish_reason == "stop"`` (the token is kept in ``token_ids``).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    max_tokens: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stop_strings: tuple[str, ...] = field(init=False, repr=False, default=())
    # Derived once, so the per-token checks cost the same however long the output grows.
    longest_stop: int = field(init=False, repr=False, default=0)
    stop_token_set: frozenset[int] = field(init=False, repr=False, default=frozenset())

    def __post_init__(self) -> None:
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, int | float):
            raise BadInput(f"temperature must be a number, got {self.temperature!r}")
        if not self.temperature >= 0.0:  # also refuses NaN
            raise BadInput(f"temperature must be >= 0, got {self.temperature}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, int | float) \
                or not 0.0 < self.top_p <= 1.0:
            raise BadInput(f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) \
                or (self.top_k < 1 and self.top_k not in (-1, 0)):
            raise BadInput(f"top_k must be -1 (off) or a positive integer, got {self.top_k!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not -2**63 <= self.seed < 2**64):  # torch.Generator's range
            raise BadInput(f"seed must be a 64-bit integer, got {self.seed!r}")
        if self.max_tokens is not None and (isinstance(self.max_tokens, bool)
                                            or not isinstance(self.max_tokens, int)
                                            or self.max_tokens < 1):
            raise BadInput(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        stop = [self.stop] if isinstance(self.stop, str) else self.stop or []
        if not isinstance(stop, list | tuple) or not all(isinstance(s, str) and s for s in stop):
            raise BadInput("stop must be a non-empty string or a list of non-empty strings")
        self.stop_strings = tuple(stop)
        self.longest_stop = max((len(s) for s in stop), default=0)
        ids = self.stop_token_ids or []
        if not isinstance(ids, list | tuple) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
            raise BadInput("stop_token_ids must be a list of non-negative integers")
        self.stop_token_ids = list(ids)
        self.stop_token_set = frozenset(ids)
        if not isinstance(self.ignore_eos, bool):
            raise BadInput(f"ignore_eos must be true or false, got {self.ignore_eos!r}")

    @property
    def greedy(self) -> bool:
        # vLLM's rule: a temperature this small is greedy; dividing the logits by it
        # (1e-300) would overflow to inf and the softmax to NaN.
        return self.temperature < GREEDY_BELOW_TEMPERATURE or self.top_k == 1
