"""Errors every part of kvledger maps to one-line messages and distinct exit codes."""

from __future__ import annotations

EXIT_OK = 0
EXIT_BAD_INPUT = 2
EXIT_DOES_NOT_FIT = 3


class KvledgerError(Exception):
    """Base class: the message is one line a user can act on."""

    exit_code = 1


class BadInput(KvledgerError):
    """The user's flags, files or manifest are wrong; exit 2."""

    exit_code = EXIT_BAD_INPUT


class DoesNotFit(KvledgerError):
    """The declared run does not fit under the memory limit; exit 3.

    ``report`` is the full multi-line refusal (breakdown and remedies).
    """

    exit_code = EXIT_DOES_NOT_FIT

    def __init__(self, report: str, plan: object | None = None) -> None:
        super().__init__(report.splitlines()[0] if report else "does not fit")
        self.report = report
        self.plan = plan


class PromptTooLong(BadInput):
    """The prompt is at or over the context limit (HTTP 413)."""


class AdmissionRejected(KvledgerError):
    """The KV ledger cannot reserve ``prompt + output cap`` right now (HTTP 429).

    Not a user error: the same request fits once running requests release blocks.
    """

    def __init__(self, needed_blocks: int, free_blocks: int) -> None:
        super().__init__(f"KV cache full: the request needs {needed_blocks} blocks, "
                         f"{free_blocks} are unreserved")
        self.needed_blocks = needed_blocks
        self.free_blocks = free_blocks
