"""A request's output constraint (a JSON schema, regex, choice, grammar or a tool call's
format), compiled for the door: from the compiler's cache at once, else on the compiler's
own threads (a heavy schema takes seconds there, never a thread or a lock another request
waits on) within ``--grammar-compile-timeout``. The compiler (``sampling/grammar.py``,
llguidance) is built at the first constrained request: a server that never sees one
never imports it."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the engine pulls torch in, the grammar compiler llguidance
    from kvledger.engine.core.engine import LLMEngine
    from kvledger.engine.sampling.grammar import GrammarCompiler, GrammarSpec
    from kvledger.engine.settings.structured_outputs_config import StructuredOutputsConfig


class Constraints:
    """The engine's output constraints, compiled within ``timeout_s`` (None: as long as
    it takes), JSON written as ``structured_outputs`` says (``sampling/json_grammar.py``)."""

    def __init__(self, engine: LLMEngine, timeout_s: float | None,
                 structured_outputs: StructuredOutputsConfig | None = None) -> None:
        self.engine = engine
        self.timeout_s = timeout_s
        self.structured_outputs = structured_outputs  # --structured-outputs-config's
        self._compiler: GrammarCompiler | None = None

    async def compile(self, spec: GrammarSpec) -> Any:
        """The compiled constraint, or GrammarTooCostly past the time limit. A compile
        other requests wait for goes on when this one's caller gives up."""
        from kvledger.engine.sampling.grammar import GrammarSpec, compile_timeout_error

        compiler, spec = self.compiler, GrammarSpec(*spec)
        grammar = compiler.lookup(spec)
        if grammar is not None:
            return grammar
        future = compiler.submit(spec)
        try:  # shielded: a timeout must not cancel a compile other requests wait for
            return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)),
                                          self.timeout_s)
        except TimeoutError:
            compiler.abandon(spec, future)
            raise compile_timeout_error(spec, self.timeout_s) from None
        except asyncio.CancelledError:
            compiler.abandon(spec, future)
            raise

    def compile_now(self, spec: GrammarSpec) -> Any:
        """The compiled constraint, compiled in this thread (``LLM``'s, which has no event
        loop to keep free), within ``timeout_s``."""
        from kvledger.engine.sampling.grammar import GrammarSpec

        return self.compiler.compile(GrammarSpec(*spec), self.timeout_s)

    @property
    def compiler(self) -> GrammarCompiler:
        """The engine's ``GrammarCompiler``, built at the first constrained request."""
        if self._compiler is None:
            from kvledger.engine.sampling.grammar import GrammarCompiler

            tokenizer = self.engine.tokenizer
            self._compiler = GrammarCompiler(tokenizer, tokenizer.eos_token_ids,
                                             self.engine.runner.config.vocab_size,
                                             cache_bytes=self.engine.config.grammar_cache_bytes,
                                             structured_outputs=self.structured_outputs)
        return self._compiler

    def close(self) -> None:
        """Drop the compiler and its threads (the server is stopping)."""
        if self._compiler is not None:
            self._compiler.close()
