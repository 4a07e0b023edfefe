"""Structured outputs: OpenAI ``response_format`` (json_object, json_schema), regex, choice and
Lark (tool calls) constraints, applied as a logits mask on llguidance (imported on the first compile only).

Why llguidance: bench/grammar_mask.py, 32,000-token byte-level BPE, per token = fill the bitmask
+ apply it to a float32 [32000] CPU row + accept, json_schema/json_object, 2-core CPU:
  llguidance 1.9.1: p50 40/44 µs, library part (fill+accept) 14/23 µs, compile <1 ms; no deps, reads tokenizer.json.
  xgrammar 0.2.9: p50 62/59 µs, library part 25/30 µs, compile 12/14 ms; needs transformers+triton.
  outlines-core 0.2.14: p50 65/65 µs, library part 23/25 µs, compile 25 ms/6.3 s (regex-only JSON).
The apply (about 30 µs of each p50) is ``grammar_matcher``'s, the same for all three.

One ``GrammarCompiler`` per engine compiles a ``GrammarSpec`` into a ``Grammar`` (cached, and
shared by every request with the same spec) on threads of its own, within a time and a memory
limit; each sequence gets its own ``GrammarMatcher`` (both in ``grammar_matcher``).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import numpy as np

from kvledger.engine.sampling.grammar_matcher import Grammar
from kvledger.engine.sampling.grammar_spec import (
    GrammarError,
    GrammarSpec,
    GrammarTooCostly,
    grammar_source,
    one_line,
)
from kvledger.engine.settings.config_values import DEFAULT_GRAMMAR_CACHE_BYTES
from kvledger.engine.settings.structured_outputs_config import StructuredOutputsConfig

CACHE_ENTRIES = 64
_MESSAGE_LIMIT = 200


def compile_workers() -> int:
    """Threads that compile grammars: a quarter of the cores, 1 to 4, at the lowest
    priority. The library drops the GIL while it compiles, so these never stall the event
    loop or the engine, which take the cores first while a client's heavy schemas compile."""
    return max(1, min(4, (os.cpu_count() or 1) // 4))


class GrammarCompiler:
    """One per engine: built from the engine's tokenizer, the EOS token ids and the model's
    vocab_size (logits width, may exceed the tokenizer's vocabulary: the extra ids are never
    allowed). The library and its view of the tokenizer are set up on the first compile.

    Compiles run on their own threads (``compile_workers``), never under a lock another
    request waits on: a cached grammar is found at once however many others compile, and
    the same spec asked twice at once is compiled once. The cache holds at most
    ``CACHE_ENTRIES`` grammars and ``cache_bytes`` of their memory (each measured as the
    growth of the process's heap while it compiled), least recently used out first; a
    grammar larger than ``cache_bytes`` on its own is refused."""

    def __init__(self, tokenizer: Any, eos_token_ids: set[int], vocab_size: int, *,
                 cache_bytes: int = DEFAULT_GRAMMAR_CACHE_BYTES, workers: int | None = None,
                 structured_outputs: StructuredOutputsConfig | None = None) -> None:
        self._tokenizer = tokenizer
        # how JSON is written (json_grammar.py; None: vLLM's defaults)
        self.structured_outputs = structured_outputs or StructuredOutputsConfig()
        self._eos_ids = frozenset(eos_token_ids)
        self._vocab_size = vocab_size
        self.cache_bytes = cache_bytes
        self._llg_tokenizer: Any = None
        self._special_ids = np.zeros(0, dtype=np.int64)  # set with _llg_tokenizer
        self._cache: OrderedDict[GrammarSpec, Grammar] = OrderedDict()
        self._cached_bytes = 0
        self._compiling: dict[GrammarSpec, list] = {}  # spec -> [future, waiters]
        self._lock = threading.Lock()  # the cache and the in-flight table only
        self._tokenizer_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(workers or compile_workers(),
                                        thread_name_prefix="kvledger-grammar",
                                        initializer=_lowest_priority)

    @property
    def cached_bytes(self) -> int:
        return self._cached_bytes

    def lookup(self, spec: GrammarSpec) -> Grammar | None:
        """The cached grammar of ``spec``, if any (and it becomes the most recent)."""
        with self._lock:
            grammar = self._cache.get(spec)
            if grammar is not None:
                self._cache.move_to_end(spec)
            return grammar

    def submit(self, spec: GrammarSpec) -> Future:
        """A future of ``spec``'s grammar: done at once when cached, else the compile
        already running or queued for it, or a new one. Its exception is a GrammarError
        when the grammar is refused. A caller that stops waiting calls ``abandon``."""
        with self._lock:
            grammar = self._cache.get(spec)
            if grammar is not None:
                self._cache.move_to_end(spec)
                done: Future = Future()
                done.set_result(grammar)
                return done
            entry = self._compiling.get(spec)
            if entry is None:
                entry = self._compiling[spec] = [self._pool.submit(self._compile_and_cache, spec), 0]
            entry[1] += 1
            return entry[0]

    def abandon(self, spec: GrammarSpec, future: Future) -> None:
        """One waiter of ``submit(spec)`` gave up: a compile nobody waits for any more is
        dropped if it has not started (a flood of distinct schemas whose clients left
        must not queue up work), and finishes into the cache if it has."""
        with self._lock:
            entry = self._compiling.get(spec)
            if entry is None or entry[0] is not future:
                return
            entry[1] -= 1
            if entry[1] <= 0 and future.cancel():
                del self._compiling[spec]

    def compile(self, spec: GrammarSpec, timeout_s: float | None = None) -> Grammar:
        """``spec``'s grammar, waiting for its compile (at most ``timeout_s``: then
        GrammarTooCostly). GrammarError if it is refused."""
        future = self.submit(spec)
        try:
            return future.result(timeout_s)
        except FutureTimeout:
            self.abandon(spec, future)
            raise compile_timeout_error(spec, timeout_s) from None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _compile_and_cache(self, spec: GrammarSpec) -> Grammar:
        try:
            before = heap_bytes()
            grammar = self._compile(spec)
            grammar.nbytes = max(heap_bytes() - before, len(spec.value or ""))
            if grammar.nbytes > self.cache_bytes:
                raise GrammarTooCostly(
                    f"the {spec.kind} compiles to {grammar.nbytes / 2**20:.1f} MiB, over the "
                    f"server's limit of {self.cache_bytes / 2**20:.1f} MiB "
                    "(--grammar-cache-bytes)")
            with self._lock:
                self._cache[spec] = grammar
                self._cached_bytes += grammar.nbytes
                while (len(self._cache) > CACHE_ENTRIES
                       or self._cached_bytes > self.cache_bytes):
                    _, evicted = self._cache.popitem(last=False)
                    self._cached_bytes -= evicted.nbytes
            return grammar
        finally:
            with self._lock:
                self._compiling.pop(spec, None)

    def _compile(self, spec: GrammarSpec) -> Grammar:
        from llguidance import LLMatcher

        if not self._eos_ids:
            raise GrammarError("this model has no EOS token, which structured outputs need")
        tokenizer = self._library_tokenizer()
        matcher = LLMatcher(tokenizer, grammar_source(spec, self.structured_outputs),
                            log_level=0)
        if matcher.is_error():
            raise GrammarError(f"invalid {spec.kind}: {one_line(matcher.get_error())}")
        grammar = Grammar(matcher, self._eos_ids, self._vocab_size,
                          (tokenizer.vocab_size + 31) // 32, self._special_ids)
        # A grammar the library accepts may still allow no output at all (a $ref cycle, an
        # empty character class): the first mask tells, so the request is a 400 here.
        allows_output, refused_specials = grammar.first_mask()
        if not allows_output:
            if refused_specials:
                spelled = tokenizer.decode_str(refused_specials[:1])
                raise GrammarError(f"the {spec.kind} allows no output: its text starts with "
                                   f"{spelled!r}, a special token of the tokenizer, which "
                                   f"constrained text cannot produce")
            raise GrammarError(f"the {spec.kind} allows no output: no token can start it")
        return grammar

    def _library_tokenizer(self) -> Any:
        with self._tokenizer_lock:  # built once, by the first compile
            if self._llg_tokenizer is None:
                from llguidance import LLTokenizer

                n_vocab = max(self._vocab_size, self._tokenizer.vocab_size)
                tokenizer = LLTokenizer(self._tokenizer.to_str(), n_vocab=n_vocab,
                                        eos_token=sorted(self._eos_ids))
                self._special_ids = np.array(
                    [i for i in range(tokenizer.vocab_size)
                     if i not in self._eos_ids and tokenizer.is_special_token(i)],
                    dtype=np.int64)
                self._llg_tokenizer = tokenizer
            return self._llg_tokenizer


def _lowest_priority() -> None:
    """Run this (compile) thread at nice 19: the engine's step and the event loop, which
    every request waits on, take the cores first, and compiles the time left over."""
    with contextlib.suppress(AttributeError, OSError):  # not Linux, or not allowed: as is
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


def compile_timeout_error(spec: GrammarSpec, timeout_s: float | None) -> GrammarTooCostly:
    return GrammarTooCostly(f"the {spec.kind} did not compile within the server's limit of "
                            f"{timeout_s:g} s (--grammar-compile-timeout)")


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


@functools.cache
def _mallinfo2() -> Any:
    try:
        function = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError):  # not glibc >= 2.33
        return None
    function.restype = _MallInfo2
    return function


def heap_bytes() -> int:
    """Bytes the process's allocator has handed out (glibc's mallinfo2: every arena and
    the mmapped chunks), which the library's allocations land in; the resident set where
    that is not available."""
    mallinfo2 = _mallinfo2()
    if mallinfo2 is not None:
        info = mallinfo2()
        return info.uordblks + info.hblkhd
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
