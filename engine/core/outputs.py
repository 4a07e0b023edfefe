"""What the engine hands back each step, in vLLM's shape."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvledger.engine.sampling.logprobs import TokenLogprobs


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[TokenLogprobs] | None = None


@dataclass
class RequestOutput:
    """One request's progress after a step.

    ``token_ids``/``text``: everything generated so far; ``new_token_ids``: this step's.
    ``finish_reason``: ``"stop"`` (EOS, stop token or stop string), ``"length"``
    (``max_tokens`` or the context limit), ``"grammar"`` (its output constraint allows no
    further token: a dead end of the client's grammar, not a fault), ``"abort"``, or
    ``"error"`` when the engine failed this request alone (``error`` says why; the other requests go on); None while
    running.
    ``logprobs``: one entry per token of ``token_ids``, when the request asked
    (``SamplingParams.logprobs``); ``prompt_logprobs``: one per prompt token (the first
    None: nothing predicts it), once the whole prompt is computed, when it asked.
    ``outputs[0]`` repeats the same fields as vLLM's ``CompletionOutput``.
    """

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    new_token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None
    prompt: str | None = field(default=None)
    error: str | None = field(default=None)
    logprobs: list[TokenLogprobs] | None = field(default=None)
    prompt_logprobs: list[TokenLogprobs | None] | None = field(default=None)

    @property
    def outputs(self) -> list[CompletionOutput]:
        return [CompletionOutput(0, self.text, self.token_ids, self.finish_reason, self.logprobs)]
