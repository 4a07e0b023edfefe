"""What the engine hands back each step, in vLLM's shape."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvledger.engine.core.so_far import SoFar
from kvledger.engine.sampling.logprobs import TokenLogprobs


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[TokenLogprobs] | None = None
    stop_reason: str | int | None = None


@dataclass
class RequestOutput:
    """One request's progress after a step.

    ``token_ids``/``text``: everything generated so far; ``new_token_ids``: this step's.
    While it runs, ``token_ids`` and ``logprobs`` are ``SoFar`` views of its sequence's
    lists (read as lists; ``list()`` one to write it as JSON), so that a step costs what it
    adds; once finished they are lists.
    ``finish_reason``: ``"stop"`` (EOS, stop token or stop string), ``"length"``
    (``max_tokens`` or the context limit), ``"grammar"`` (its output constraint allows no
    further token: a dead end of the client's grammar, or bad words that take out every
    one of its allowed token ids; not a fault), ``"abort"``, or
    ``"error"`` when the engine failed this request alone (``error`` says why; the other requests go on); None while
    running.
    ``logprobs``: one entry per token of ``token_ids``, when the request asked
    (``SamplingParams.logprobs``); ``prompt_logprobs``: one per prompt token (the first
    None: nothing predicts it), once the whole prompt is computed, when it asked.
    ``stop_reason``: the stop string or stop token id that finished it, as vLLM's (None
    for EOS and the other reasons). ``outputs[0]`` repeats the same fields as vLLM's
    ``CompletionOutput``.
    """

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] | SoFar[int]
    new_token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None
    prompt: str | None = field(default=None)
    error: str | None = field(default=None)
    logprobs: list[TokenLogprobs] | SoFar[TokenLogprobs] | None = field(default=None)
    prompt_logprobs: list[TokenLogprobs | None] | None = field(default=None)
    stop_reason: str | int | None = field(default=None)  # vLLM's: the stop string or token id

    @property
    def outputs(self) -> list[CompletionOutput]:
        return [CompletionOutput(0, self.text, self.token_ids, self.finish_reason, self.logprobs,
                                 self.stop_reason)]


def request_output(seq, new_token_ids: list[int]) -> RequestOutput:
    """What a step reports of ``seq`` (a ``core.sequence.Sequence``): ``new_token_ids`` this
    step, its text so far, and whether and why it finished. Its ids and logprobs so far are
    views while it runs (no copy: a step's cost does not grow with the output), copies
    once it finished (its last output, which callers keep)."""
    text = seq.text
    if seq.params.stop_strings and not seq.is_finished:
        # Hold back what could be the start of a stop string, so streamed text never
        # shows characters that a later cut removes.
        text = text[:max(0, len(text) - seq.params.longest_stop + 1)]
    so_far = list if seq.is_finished else SoFar
    output = RequestOutput(seq.request_id, seq.prompt_token_ids, so_far(seq.output_token_ids),
                           new_token_ids, text, seq.is_finished, seq.finish_reason,
                           stop_reason=seq.stop_reason)
    if seq.logprobs is not None:
        output.logprobs = so_far(seq.logprobs)
    if seq.prompt_logprobs is not None and seq.prompt_computed:
        output.prompt_logprobs = seq.prompt_logprobs  # complete: it never changes again
    return output
