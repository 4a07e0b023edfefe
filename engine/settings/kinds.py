"""The kinds of value a setting takes (``declare.py`` declares the settings): how its flag
reads one (``parse``, argparse's type), how a config checks one given in Python or a spec
(``check``), and the domain the operator types in the CRD; the SIZE grammar.

Torch-free and Kubernetes-free: a ``Kind`` names its domain (``"positive"``, ``"size"``,
...) and the operator owns what that is in OpenAPI (``operator/api/setting_schema.py``).
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from kvledger.engine.errors import BadInput, shown
from kvledger.engine.settings.vllm_numbers import human_readable_int

# The size grammar (Kubernetes quantities); the CRD's pattern is built from it (operator/api/setting_schema.py).
SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGTPE]i?B?|[kKMGTPE]B|[kKMGTPE]|B)?\s*$")
_BINARY = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40, "P": 2**50, "E": 2**60}
_DECIMAL = {"K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18}
# The largest size: what an int64 holds, as a Kubernetes quantity's bytes do (8 EiB).
MAX_SIZE_BYTES = 2**63 - 1
MAX_SIZE_DIGITS = len(str(MAX_SIZE_BYTES))


def parse_size(text: str | int) -> int:
    """Bytes from a SIZE: ``40GiB``/``40Gi`` (binary), ``40GB``/``40G`` (decimal), ``512MiB``,
    or plain bytes, as Kubernetes quantities. Raises BadInput on anything else."""
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise BadInput(f"size must not be negative: {shown(text)}")
        return _at_most_8_eib(text, text)
    match = SIZE_RE.match(str(text))
    if not match:
        raise BadInput(f"bad size {shown(text)}: use e.g. 40GiB, 40Gi, 40GB, 40G, 512MiB or "
                       "plain bytes")
    number, unit = match.group(1), (match.group(2) or "")
    unit = unit.upper()
    if unit in ("", "B"):
        scale = 1
    elif "I" in unit:
        scale = _BINARY[unit[0]]
    else:
        scale = _DECIMAL[unit[0]]
    if scale == 1 and "." in number:
        raise BadInput(f"bad size {shown(text)}: a byte count must be a whole number")
    whole, _, fraction = number.partition(".")
    # Leading zeros go first: int() refuses a string of more than 4,300 digits, zeros too.
    whole = whole.lstrip("0") or "0"
    # Exact (a float rounds a byte count past 2**53, and overflows on a long one); a number
    # with more digits than the largest size is refused without being computed.
    size = (int(Fraction(f"{whole}.{fraction[:MAX_SIZE_DIGITS] or 0}") * scale)
            if len(whole) <= MAX_SIZE_DIGITS else MAX_SIZE_BYTES + 1)
    return _at_most_8_eib(size, text)


def _at_most_8_eib(size: int, text: object) -> int:
    if size > MAX_SIZE_BYTES:
        raise BadInput(f"bad size {shown(text)}: more than 8 EiB less a byte, the most a "
                       "size may be")
    return size


def size_arg(text: str) -> int:
    """argparse type for a SIZE flag."""
    try:
        return parse_size(text)
    except BadInput as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def positive_seconds(text: str) -> float:
    """argparse type for a positive, finite number of seconds."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds > 0, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected seconds > 0, got {text!r}")
    return value


def positive_int(text: str) -> int:
    """argparse type for a positive integer."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def token_count(text: str) -> int:
    """argparse type for a positive count of tokens, in vLLM's human-readable forms
    (``32k``, ``32K``, ``25.6k``: ``vllm_numbers``)."""
    try:
        value = human_readable_int(text)
    except BadInput as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive count of tokens, got {text!r}")
    return value


def count(text: str) -> int:
    """argparse type for a whole number >= 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 0, got {text!r}")
    return value


def seconds_or_zero(text: str) -> float:
    """argparse type for a finite number of seconds >= 0 (0: at once)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds >= 0, got {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected seconds >= 0, got {text!r}")
    return value


def fraction(text: str) -> float:
    """argparse type for a number in (0, 1]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}") from None
    if not (0.0 < value <= 1.0):
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}")
    return value


def share(text: str) -> float:
    """argparse type for a share in [0, 1): ``0.1`` or ``10%``."""
    number = text[:-1] if text.endswith("%") else text
    try:
        value = float(number) / (100.0 if number != text else 1.0)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a share such as 0.1 or 10%, got {text!r}") \
            from None
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"expected a share in [0, 1) (0% to 99.9%), got {text!r}")
    return value


@dataclass(frozen=True)
class Kind:
    """A setting's domain: how its flag reads a value (``parse``, or ``values`` as the
    choices), how the config checks one given in Python or a spec (``check(flag, value)``
    raises BadInput, one line), and its ``domain``, which the CRD types
    (``operator/api/setting_schema.py``). ``render`` writes a value back as flag arguments;
    ``from_spec`` reads the InferenceService spec's value (None: it is the config's as is)."""

    domain: str
    parse: Callable[[str], Any] | None = None
    check: Callable[[str, Any], None] | None = None
    values: tuple[Any, ...] = ()
    action: Any = None  # argparse's, for an on/off flag
    nargs: str | None = None  # "+": a list (the flag's default is then None)
    metavar: str | None = None
    render: Callable[[Any], list[str]] | None = None
    from_spec: Callable[[Any], Any] | None = None


def _positive(flag: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise BadInput(f"{flag} must be a positive integer, got {value!r}")


def _not_negative(flag: str, value: Any) -> None:
    if value < 0:
        raise BadInput(f"{flag} must not be negative")


def _not_empty(flag: str, value: Any) -> None:
    if not value:
        raise BadInput(f"{flag} must not be empty")


def _in_unit_interval(flag: str, value: Any) -> None:
    if not (0.0 < value <= 1.0):
        raise BadInput(f"{flag} must be in (0, 1], got {value}")


def _share(flag: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0.0 <= value < 1.0:
        raise BadInput(f"{flag} must be a share in [0, 1), got {value!r}")


def _seconds(flag: str, value: Any) -> None:
    if (isinstance(value, bool) or not isinstance(value, int | float)
            or not 0 < value < float("inf")):
        raise BadInput(f"{flag} must be a positive number of seconds, got {value!r}")


def _seconds_or_zero(flag: str, value: Any) -> None:
    if (isinstance(value, bool) or not isinstance(value, int | float)
            or not 0 <= value < float("inf")):
        raise BadInput(f"{flag} must be a number of seconds >= 0, got {value!r}")


def _count(flag: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise BadInput(f"{flag} must be a whole number >= 0, got {value!r}")


def choice(values: tuple[Any, ...]) -> Kind:
    """One of ``values`` (argparse's choices; the CRD's enum)."""

    def check(flag: str, value: Any) -> None:
        if value not in values:
            raise BadInput(f"{flag} must be one of {', '.join(map(str, values))}, got {value!r}")

    return Kind("choice", check=check, values=values)


TEXT = Kind("text")
PATH = Kind("text", check=_not_empty)
INTEGER = Kind("integer", parse=int)
POSITIVE_INT = Kind("positive", parse=positive_int, check=_positive)
COUNT = Kind("count", parse=count, check=_count, metavar="N")  # 0 and up
TOKENS = Kind("positive", parse=token_count, check=_positive, metavar="N")  # 32k as vLLM reads it
FRACTION = Kind("fraction", parse=fraction, check=_in_unit_interval)
SHARE = Kind("share", parse=share, check=_share, metavar="SHARE")  # 0.1 or 10%
SECONDS = Kind("seconds", parse=positive_seconds, check=_seconds, metavar="SECONDS")
SECONDS_OR_ZERO = Kind("seconds_or_zero", parse=seconds_or_zero, check=_seconds_or_zero,
                       metavar="SECONDS")  # 0: at once
SIZE = Kind("size", parse=size_arg, check=_positive, metavar="SIZE")  # a SIZE string
FREE_SIZE = Kind("size", parse=size_arg, check=_not_negative, metavar="SIZE")
BYTES = Kind("bytes", parse=size_arg, check=_positive, metavar="SIZE")  # a count or a SIZE
SWITCH = Kind("boolean", action=argparse.BooleanOptionalAction)  # --x / --no-x
ON = Kind("boolean", action="store_true")  # --x, off unless given
