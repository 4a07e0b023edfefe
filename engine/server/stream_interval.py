"""vLLM's ``--stream-interval N`` and a request's own ``stream_interval``: a streamed
choice goes out every N tokens rather than every token (fewer, larger chunks: less work
per token for the server and the client), its first output and its last at once.

The request's value raises the server's, never lowers it (vLLM clamps it up). An output
held back is not lost: each output carries the whole answer so far, and the streams
(``answer_stream``, ``responses_stream``) send what it adds to what went out, so the text,
logprobs, tool calls and reasoning read the same however the answer was cut.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvledger.engine.server.protocol import GenerationRequest
from kvledger.engine.server.state import ServerState


def interval_of(state: ServerState, req: GenerationRequest) -> int:
    """The tokens per chunk of ``req``'s stream: the larger of the server's and its own."""
    server = state.options.stream_interval
    return server if req.stream_interval is None else max(req.stream_interval, server)


@dataclass
class Pacing:
    """When one streamed choice's outputs go out (vLLM's output processor's rule)."""

    interval: int
    sent_tokens: int = 0  # the choice's tokens when its last output went out

    def due(self, tokens: int, finished: bool) -> bool:
        """Whether the output that brings the choice to ``tokens`` goes out now: always
        under an interval of 1; else its first, its last, and one ``interval`` tokens on
        from the last sent."""
        if self.interval > 1 and not (finished or self.sent_tokens == 0
                                      or tokens - self.sent_tokens >= self.interval):
            return False
        self.sent_tokens = tokens
        return True
