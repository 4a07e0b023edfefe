"""What one ``vllm serve`` flag that kvledger does not define itself does here: a ``Rule``
(a no-op and why, the values accepted, read, or refused and why), the helpers that write
the common ones, and the one line a refused flag ends in. ``vllm_rules.py`` holds the
table (``RULES``); ``vllm_flags.py`` makes the flags of it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Rule:
    """What one vLLM flag does here.

    ``accepts`` empty and ``unsupported`` empty: accepted as a no-op (``why`` says why
    nothing changes) whatever its value, or any value ``parse`` (vLLM's argparse type)
    reads and ``choices`` (vLLM's argparse choices) holds. ``accepts`` given: those values
    are accepted (they ask for what kvledger does anyway), any other is refused.
    ``unsupported`` given and no ``accepts``: refused whenever it is given. ``read``: the
    value ``parse`` gives is kept as the namespace's ``_vllm_<flag>`` for
    ``config_flags.py`` to read. ``reasons``: why a refused value is refused, for the
    values vLLM knows (its other reasoning parsers).
    """

    why: str = ""
    unsupported: str = ""
    accepts: frozenset[str] = frozenset()
    nargs: int | str | None = "*"
    read: bool = False  # accepted and read (``why`` says how), not a no-op
    parse: Callable[[str], Any] | None = None
    choices: tuple[str, ...] | None = None
    reasons: tuple[tuple[str, str], ...] = ()  # (value, why it is refused)
    secret: bool = False  # its value is a credential: never echoed in the refusal

    @property
    def refused_always(self) -> bool:
        return bool(self.unsupported) and not self.accepts


def noop(why: str, nargs: int | str = 0, parse: Callable[[str], Any] | None = None,
         choices: tuple[str, ...] | None = None) -> Rule:
    return Rule(why=why, nargs=nargs, parse=parse, choices=choices)


def read(why: str, parse: Callable[[str], Any]) -> Rule:
    return Rule(why=why, nargs=1, read=True, parse=parse)


def only(values: Sequence[str], unsupported: str, why: str,
         reasons: dict[str, str] | None = None) -> Rule:
    return Rule(why=why, unsupported=unsupported, accepts=frozenset(values), nargs=None,
                reasons=tuple(sorted((reasons or {}).items())))


def refuse(unsupported: str, secret: bool = False) -> Rule:
    return Rule(unsupported=unsupported, secret=secret)


def lacks(flag: str, unsupported: str) -> dict[str, Rule]:
    """An on/off flag (``--X``/``--no-X``, off by default in vLLM) that turns on what
    kvledger lacks: ``--X`` refused saying so, ``--no-X`` (vLLM's default) a no-op."""
    return {flag: refuse(unsupported),
            "--no-" + flag[2:]: noop(f"off, vLLM's default; kvledger does not support "
                                     f"{unsupported.partition(':')[0]}")}


def alone(flag: str) -> str:
    """Why a flag that acts only together with ``flag``, which kvledger refuses, changes
    nothing."""
    return f"vLLM uses it only with {flag}, which kvledger refuses"


def refusal(flag: str, values: Sequence[str], rule: Rule | None) -> str:
    """The one line a refused flag ends in: the flag as typed, its value, and why."""
    given = " ".join([flag, *(["***"] if rule is not None and rule.secret and values
                               else values)])
    if rule is None or not rule.unsupported:
        return f"{given}: kvledger does not support vLLM's {flag}"
    names = sorted(rule.accepts)
    listed = " or ".join([", ".join(names[:-1]), names[-1]] if len(names) > 2 else names)
    accepted = f" (only {listed})" if names else ""
    why = next((f": {why}" for value, why in rule.reasons if value in values), "")
    return f"{given}: kvledger does not support {rule.unsupported}{accepted}{why}"
