"""A request's cost per output token on the answer path, at 1k, 4k and 16k tokens: the
claim is that it does not grow with the answer's length (one tenant's long answer must
not slow the others sharing the event loop and the engine thread).

Each case scripts an answer's text, tokenizes it with a built-in model's tokenizer (its
markers added as Qwen's are), and feeds its ids one a step as the engine does: the real
``Sequence.append`` (detokenizer, stop checks) and ``request_output``, into the real
streamed answer (``answer_stream.stream`` or ``responses_stream.stream``: the tool-call
reader, the reasoning split, usage and the SSE events) whose writer discards the bytes.
No model runs. The figure is CPU milliseconds per 1k output tokens, per length.

    .venv/bin/python bench/stream_cost.py [--lengths 1000,4000,16000]    # ~1 minute

Prints a table, then the figures as JSON; exits 1 when a case's figure at the longest
length is over 1.5x its figure at the shortest (the cost per token grew with the length).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

LIMIT = 1.5  # the longest length's figure over the shortest's
MARKERS = ["<think>", "</think>", "<tool_call>", "</tool_call>"]
WORDS = ["the", "sky", "is", "blue", "because", "air", "scatters", "short", "light", "more", "than", "long", "light"]
TOOL = {"type": "function", "function": {"name": "write", "parameters": {
    "type": "object", "properties": {"text": {"type": "string"}}}}}


def prose(chars: int, spaces: int = 1) -> str:
    """About ``chars`` characters of words, ``spaces`` spaces between them."""
    out, n = [], 0
    while n < chars:
        word = WORDS[len(out) % len(WORDS)]
        out.append(word)
        n += len(word) + spaces
    return (" " * spaces).join(out)


# Each case: (route, its request's extra fields, the server's options, its answer's text
# for about ``n`` tokens). A token of this tokenizer is ~4 characters of prose.
CASES = {
    "plain": ("chat", {}, {}, lambda n: prose(4 * n)),
    "logprobs": ("completions", {"logprobs": 2}, {}, lambda n: prose(4 * n)),
    # A model that writes a long run of spaces (half its answer): in a call's arguments,
    # in content, at the end of its reasoning.
    "hermes_spaces": ("chat", {"tools": [TOOL]}, {"tool_call_parser": "hermes"},
                      lambda n: '<tool_call>\n{"name": "write", "arguments": {"text": "'
                      + prose(2 * n) + " " * (16 * n) + '"}}\n</tool_call>'),
    "content_spaces": ("chat", {"tools": [TOOL]}, {"tool_call_parser": "hermes"},
                       lambda n: prose(2 * n) + " " * (16 * n) + "done"),
    "reasoning_spaces": ("chat", {}, {"reasoning_parser": "step3p5"},
                         lambda n: "<think>" + prose(2 * n) + " " * (16 * n) + "</think>"),
    "pythonic": ("chat", {"tools": [TOOL]}, {"tool_call_parser": "pythonic"},
                 lambda n: '[write(text="' + prose(4 * n) + '")]'),
    "qwen3_coder": ("chat", {"tools": [TOOL]}, {"tool_call_parser": "qwen3_coder"},
                    lambda n: "<tool_call>\n<function=write>\n<parameter=text>\n"
                    + prose(4 * n) + "\n</parameter>\n</function>\n</tool_call>"),
    "deepseek_r1_usage": ("chat", {"stream_options": {"include_usage": True,
                                                      "continuous_usage_stats": True}},
                          {"reasoning_parser": "deepseek_r1"},
                          lambda n: "<think>" + prose(3 * n) + "</think>" + prose(n)),
    "responses_reasoning": ("responses", {}, {"reasoning_parser": "deepseek_r1"},
                            lambda n: "<think>" + prose(3 * n) + "</think>" + prose(n)),
}


def tokenizer_dir(work: Path) -> Path:
    """The built-in tiny-llama's checkpoint, its tokenizer trained again with ``MARKERS``
    as added (not special) tokens, as Qwen's holds them."""
    from tokenizers import processors

    from kvledger.engine.model.bpe import train_byte_level_bpe
    from kvledger.engine.model.builtin import CORPUS, SPECIAL_TOKENS, TOKENIZER_VOCAB, write_model

    out = write_model("tiny-llama", work / "model")
    tokenizer = train_byte_level_bpe(CORPUS.read_text().splitlines(),
                                     TOKENIZER_VOCAB - len(MARKERS), SPECIAL_TOKENS)
    tokenizer.add_tokens(MARKERS)
    bos = tokenizer.token_to_id("<s>")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)])
    tokenizer.save(str(out / "tokenizer.json"))
    return out


class _Discard:
    """An HTTP payload writer that drops what the answer writes (its size counted)."""

    buffer_size = output_size = 0
    length = None
    transport = None

    def __init__(self) -> None:
        self.written = 0

    def enable_chunking(self) -> None: ...

    def enable_compression(self, *_, **__) -> None: ...

    async def write_headers(self, *_) -> None: ...

    def send_headers(self, *_) -> None: ...

    def set_eof(self) -> None: ...

    async def write(self, data, *_, **__) -> None:
        self.written += len(data)

    async def write_eof(self, *_) -> None: ...

    async def drain(self) -> None: ...


class _Generation:
    """What the answer reads of a request's generation: one choice of one prompt."""

    def __init__(self, prompt_ids: list[int], params) -> None:
        self.runs = [SimpleNamespace(prompt_ids=prompt_ids, cap_tokens=params.max_tokens,
                                     choices=[SimpleNamespace(params=params)])]
        self.num_choices, self.prompt_tokens, self.cached_tokens = 1, len(prompt_ids), 0

    def progress(self, counts: list[int]) -> None: ...


def _parts(case: str, tokenizer):
    """The server's state and a request's parsed body and plans, as the route makes them."""
    from kvledger.engine.server.protocol import parse_chat, parse_completion
    from kvledger.engine.server.reasoning import ReasoningTokens
    from kvledger.engine.server.reasoning_request import reasoning_plan
    from kvledger.engine.server.responses_request import parse_responses
    from kvledger.engine.server.state import ServeOptions, ServerState
    from kvledger.engine.server.tools.calls import NO_TOOLS, control_token_ids, tool_plan

    route, extra, options, _ = CASES[case]
    auto = {"enable_auto_tool_choice": True} if "tool_call_parser" in options else {}
    state = ServerState(ServeOptions(**options, **auto))
    if "reasoning_parser" in options:
        state.reasoning = ReasoningTokens.of(options["reasoning_parser"], tokenizer)
    state.token_text = lambda token_id: tokenizer.decode([token_id])
    ask = [{"role": "user", "content": "Why is the sky blue?"}]
    if route == "chat":
        req = parse_chat({"model": "m", "messages": ask, "stream": True, **extra})
    elif route == "completions":
        req = parse_completion({"model": "m", "prompt": "Why", "stream": True, **extra})
    else:
        req = parse_responses({"model": "m", "input": ask, "stream": True, **extra})
    tools = NO_TOOLS
    if getattr(req, "tools", None):
        tools = tool_plan(req.tools, req.tool_choice, req.parallel_tool_calls,
                          auto_enabled=True, parser=options["tool_call_parser"],
                          chat_template=None, specials=control_token_ids(tokenizer))
    reasoning = reasoning_plan(state, req) if route != "completions" else None
    return state, req, tools, reasoning


async def _answer(case: str, tokenizer, ids: list[int]) -> tuple[float, int]:
    """CPU seconds of one streamed answer of ``ids``, and the bytes it wrote."""
    from aiohttp.test_utils import make_mocked_request

    from kvledger.engine.core.outputs import request_output
    from kvledger.engine.core.sequence import Sequence, SequenceStatus
    from kvledger.engine.sampling.params import SamplingParams
    from kvledger.engine.server import answer_stream, responses_stream
    from kvledger.engine.server.answers import Prepared
    from kvledger.engine.server.metrics import RequestTimeline

    state, req, tools, reasoning = _parts(case, tokenizer)
    prompt = tokenizer.encode("Why is the sky blue?")
    params = SamplingParams(max_tokens=len(ids) + 1, ignore_eos=True,
                            logprobs=req.logprobs_k(), kept_special_ids=tools.kept_ids)
    detok = tokenizer.detokenizer(prompt, params.kept_special_ids)
    seq = Sequence("r", prompt, params, len(ids), None, detok, None)
    p = Prepared(req, "r", _Generation(prompt, params), RequestTimeline(state.metrics, time.time()),
                 0, tools, reasoning=reasoning)
    writer = _Discard()
    request = make_mocked_request("POST", "/", writer=writer)
    logprob = None if params.logprobs is None else _logprobs(params.logprobs)
    last = len(ids) - 1

    async def outputs():
        for i, token_id in enumerate(ids):
            reason = seq.append(token_id, logprob, set())
            if i == last:  # the last scripted token ends it
                reason = reason or "stop"
            if reason is not None:
                seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason
            yield 0, request_output(seq, [token_id])

    stream = responses_stream.stream if CASES[case][0] == "responses" else answer_stream.stream
    started = time.process_time()
    await stream(request, state, p, outputs())
    return time.process_time() - started, writer.written


def _logprobs(k: int):
    from kvledger.engine.sampling.logprobs import TokenLogprobs

    return TokenLogprobs(5, -0.5, 1, [(5, -0.5), (6, -1.5), (7, -2.0)][:k])


def run(lengths: list[int], cases: list[str]) -> dict[str, dict[int, float]]:
    from kvledger.engine.model.tokenizer import Tokenizer

    work = Path(tempfile.mkdtemp(prefix="stream-cost-"))
    try:
        tokenizer = Tokenizer(tokenizer_dir(work))
        figures: dict[str, dict[int, float]] = {}
        for case in cases:
            figures[case] = {}
            for n in lengths:
                ids = tokenizer.encode(CASES[case][3](n), add_special_tokens=False)[:n]
                seconds, _ = asyncio.run(_answer(case, tokenizer, ids))
                figures[case][n] = round(seconds * 1000 / (len(ids) / 1000), 1)
                print(f"{case:22} {n:>7} tokens {figures[case][n]:9.1f} ms per 1k", flush=True)
        return figures
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="1000,4000,16000")
    parser.add_argument("--cases", default=",".join(CASES))
    args = parser.parse_args()
    lengths = sorted(int(x) for x in args.lengths.split(","))
    cases = args.cases.split(",")
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        print(f"unknown case(s): {', '.join(unknown)}; known: {', '.join(CASES)}",
              file=sys.stderr)
        return 2
    figures = run(lengths, cases)
    failed = [c for c, f in figures.items() if f[lengths[-1]] > LIMIT * f[lengths[0]]]
    for case in failed:
        print(f"FAIL {case}: {figures[case][lengths[-1]]} ms per 1k tokens at "
              f"{lengths[-1]} tokens, over {LIMIT}x its {figures[case][lengths[0]]} at "
              f"{lengths[0]}", file=sys.stderr)
    print(json.dumps({"limit_ratio": LIMIT, "ms_per_1k_tokens": figures,
                      "failed": failed}))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
