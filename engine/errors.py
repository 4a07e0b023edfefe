"""Errors every part of kvledger maps to one-line messages and distinct exit codes."""

from __future__ import annotations

EXIT_OK = 0
EXIT_BAD_INPUT = 2
EXIT_DOES_NOT_FIT = 3


# Of a value a refusal quotes: a hostile file's value can run to megabytes, a message is one
# line a person reads.
SHOWN_CHARS = 200


def clip(text: str, limit: int = SHOWN_CHARS) -> str:
    """``text`` cut to ``limit`` characters, saying how long it was."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} chars)"


def shown(value: object) -> str:
    """``repr(value)`` as a refusal quotes it (``clip``)."""
    return clip(repr(value))


def plain(text: str) -> str:
    """``text`` (an image, a folder, a name) as a refusal names it: as written where it is
    printable, else quoted as ``shown`` quotes it (a newline in it would break the line);
    clipped either way."""
    return clip(text) if text.isprintable() else shown(text)


def some(names: list[str], *, quote: bool = True, named: int = 3) -> str:
    """The first ``named`` of ``names`` (each quoted with ``quote``, and clipped) and how
    many more, for a one-line refusal."""
    listed = ", ".join(shown(n) if quote else clip(n) for n in names[:named])
    more = len(names) - named
    return f"{listed} and {more} more" if more > 0 else listed


class KvledgerError(Exception):
    """Base class: the message is one line a user can act on."""

    exit_code = 1


class BadInput(KvledgerError):
    """The user's flags, files, manifest or request are wrong; exit 2 (HTTP 400).
    ``param`` names the request field at fault, when one is (OpenAI's error ``param``)."""

    exit_code = EXIT_BAD_INPUT

    def __init__(self, message: str = "", param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class UnknownModel(BadInput):
    """A request names neither the served model nor one of its LoRA adapters (HTTP 404)."""

    def __init__(self, name: str, served: str, adapters: int) -> None:
        more = f" and {adapters} LoRA adapters" if adapters else ""
        super().__init__(f"the model {name!r} does not exist (no model or LoRA adapter has "
                         f"that name); this server serves {served!r}{more}", "model")


class DoesNotFit(KvledgerError):
    """The declared run does not fit under the memory limit; exit 3.

    ``report`` is the full multi-line refusal (breakdown and remedies).
    """

    exit_code = EXIT_DOES_NOT_FIT

    def __init__(self, report: str, plan: object | None = None) -> None:
        super().__init__(report.splitlines()[0] if report else "does not fit")
        self.report = report
        self.plan = plan


class BadConstraint(BadInput):
    """A request's output constraint (JSON schema, regex, choice, tool-call grammar) cannot
    be compiled (HTTP 400); ``costly``: it went over the compiler's limits or time."""

    costly = False


class PromptTooLong(BadInput):
    """The prompt is at or over the context limit: no room for one output token (HTTP 400)."""

    def __init__(self, prompt_tokens: int, max_model_len: int) -> None:
        super().__init__(f"the prompt has {prompt_tokens} tokens; the context limit is "
                         f"{max_model_len}, which must also hold at least one output token")
        self.prompt_tokens = prompt_tokens
        self.max_model_len = max_model_len


class CapTooLarge(BadInput):
    """The prompt plus the requested output cap (``max_tokens``) exceed the context limit
    (HTTP 400). ``room_tokens`` is the largest cap that fits."""

    def __init__(self, prompt_tokens: int, max_tokens: int, max_model_len: int) -> None:
        super().__init__(f"max_tokens {max_tokens} + {prompt_tokens} prompt tokens exceed "
                         f"the context limit of {max_model_len}")
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.max_model_len = max_model_len

    @property
    def room_tokens(self) -> int:
        return self.max_model_len - self.prompt_tokens


class PoolTooSmall(BadInput):
    """A request needs more blocks than the whole KV pool holds, so it can never be admitted,
    whatever is cached or running (HTTP 400)."""

    def __init__(self, needed_blocks: int, pool_blocks: int, *, num_tokens: int = 0,
                 count: int = 1, kept_blocks: int = 0) -> None:
        kept = f", {kept_blocks} of them kept for urgent requests" if kept_blocks else ""
        super().__init__(f"a prompt needs {needed_blocks} KV blocks; the pool has "
                         f"{pool_blocks}{kept}")
        self.needed_blocks = needed_blocks
        self.pool_blocks = pool_blocks
        self.num_tokens = num_tokens  # prompt + cap of each choice
        self.count = count            # the choices (``n``) that each need them
        self.kept_blocks = kept_blocks  # of the pool's, not for its priority (headroom)


class AdmissionRejected(KvledgerError):
    """The KV ledger cannot admit ``prompt + output cap`` right now (HTTP 429); over-committing
    (``--admission safe``) ``reason`` says why.

    Not a user error: the same request fits once running requests release blocks.
    """

    def __init__(self, needed_blocks: int, free_blocks: int, reason: str | None = None) -> None:
        super().__init__(f"KV cache full: the request needs {needed_blocks} blocks, "
                         + (f"and {reason}" if reason else f"{free_blocks} are unreserved"))
        self.needed_blocks = needed_blocks
        self.free_blocks = free_blocks


class KVCacheFull(AdmissionRejected):
    """The admission line refuses a request now (its line is full, it may not wait, or its
    wait ran out): ``needed_blocks`` are not free, and ``wait_s`` is the jittered wait after
    which enough of them are due back (HTTP 429 with Retry-After). ``reason`` names the
    limit for ``kvledger_requests_rejected_total``."""

    reason = "kv_cache_full"

    def __init__(self, needed_blocks: int, free_blocks: int, wait_s: float) -> None:
        KvledgerError.__init__(self, f"the KV cache cannot hold this request now ({needed_blocks} "
                                     f"blocks needed, {free_blocks} free); retry in {wait_s:.1f}s")
        self.needed_blocks = needed_blocks
        self.free_blocks = free_blocks
        self.wait_s = wait_s


class LineFull(KVCacheFull):
    """The admission line holds ``max_queue_len`` waiters already (--max-queue-len): the
    cause is the line, not the KV cache (HTTP 429 ``queue_full``, with Retry-After)."""

    reason = "queue_full"

    def __init__(self, waiting: int, max_queue_len: int, wait_s: float) -> None:
        KvledgerError.__init__(self, f"the admission line is full ({waiting} requests wait, "
                                     f"--max-queue-len {max_queue_len}); retry in {wait_s:.1f}s")
        self.needed_blocks = self.free_blocks = 0
        self.wait_s = wait_s


class TenantLineFull(KVCacheFull):
    """The request's tenant holds every place in line it may (its share: the line's other
    places stay for other tenants): HTTP 429 ``tenant_queue_full``, with Retry-After."""

    reason = "tenant_queue_full"

    def __init__(self, tenant: str, waiting: int, wait_s: float) -> None:
        KvledgerError.__init__(self, f"tenant {tenant} already has {waiting} requests waiting, "
                                     f"all the places in line it may hold "
                                     f"(--max-queue-len-per-tenant); retry in {wait_s:.1f}s")
        self.needed_blocks = self.free_blocks = 0
        self.wait_s = wait_s


class EngineSleeping(KvledgerError):
    """The engine is asleep, or waking (sleep mode): no request is taken until it is
    awake, in about ``retry_after_s`` (HTTP 503 with Retry-After)."""

    def __init__(self, level: int, retry_after_s: float, *, waking: bool = False) -> None:
        state = "waking" if waking else f"asleep (level {level})"
        super().__init__(f"the engine is {state}: POST /wake_up wakes it; retry in "
                         f"{retry_after_s:.0f}s")
        self.level = level
        self.retry_after_s = retry_after_s


class EngineDeadError(RuntimeError):
    """The engine's step loop failed, or a rank is gone: no request can make progress
    (HTTP 503)."""


class EngineFailed(RuntimeError):
    """The engine cannot make progress (``core/engine.py``'s ``MAX_CONSECUTIVE_FAILED_STEPS``
    failed forward passes in a row, or a tensor-parallel rank gone)."""


class NonFiniteLogits(ArithmeticError):
    """One request's logits came out NaN or infinite: its own (its adapter's, its input's)."""

    def __init__(self) -> None:
        super().__init__("the model's logits for this request are not finite (NaN or "
                         "infinity): its LoRA adapter or its input overflowed")
