"""One declaration per engine setting: its flag, its domain, its help and its CRD field.

Each field of ``EngineConfig`` (``engine/config.py``) is declared with ``setting(...)``,
which stores a ``Setting`` in the field's metadata. Everything else is generated from
those declarations: the command line's flags (``add_setting_flags``), the check of each
value (``check_settings``), a config turned back into flags for the pod
(``render_flags``), and, in the operator, the CRD's ``spec.engine`` and ``spec.memory``
properties (``operator/api/crd_schema.py``) and the spec's mapping onto the config
(``operator/api/spec.py``). A new field is one declaration, then ``make crd``.

Torch-free and Kubernetes-free: a ``Kind`` names its domain (``"positive"``, ``"size"``,
...) and the operator owns what that is in OpenAPI.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import MISSING, Field, dataclass, field, fields
from typing import Any

from kvledger.engine.errors import BadInput
from kvledger.engine.vllm_numbers import human_readable_int

# The size grammar (Kubernetes quantities); the CRD's pattern is built from it (operator/api/crd_schema.py).
SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGTPE]i?B?|[kKMGTPE]B|[kKMGTPE]|B)?\s*$")
_BINARY = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40, "P": 2**50, "E": 2**60}
_DECIMAL = {"K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18}


def parse_size(text: str | int) -> int:
    """Bytes from a SIZE: ``40GiB``/``40Gi`` (binary), ``40GB``/``40G`` (decimal), ``512MiB``,
    or plain bytes, as Kubernetes quantities. Raises BadInput on anything else."""
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise BadInput(f"size must not be negative: {text}")
        return text
    match = SIZE_RE.match(str(text))
    if not match:
        raise BadInput(f"bad size {text!r}: use e.g. 40GiB, 40Gi, 40GB, 40G, 512MiB or plain bytes")
    number, unit = match.group(1), (match.group(2) or "")
    unit = unit.upper()
    if unit in ("", "B"):
        scale = 1
    elif "I" in unit:
        scale = _BINARY[unit[0]]
    else:
        scale = _DECIMAL[unit[0]]
    value = float(number) * scale
    if scale == 1 and "." in number:
        raise BadInput(f"bad size {text!r}: a byte count must be a whole number")
    return int(value)


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
    (``operator/api/crd_schema.py``). ``render`` writes a value back as flag arguments."""

    domain: str
    parse: Callable[[str], Any] | None = None
    check: Callable[[str, Any], None] | None = None
    values: tuple[Any, ...] = ()
    action: Any = None  # argparse's, for an on/off flag
    nargs: str | None = None  # "+": a list (the flag's default is then None)
    metavar: str | None = None
    render: Callable[[Any], list[str]] | None = None


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
TOKENS = Kind("positive", parse=token_count, check=_positive, metavar="N")  # 32k as vLLM reads it
FRACTION = Kind("fraction", parse=fraction, check=_in_unit_interval)
SHARE = Kind("share", parse=share, check=_share, metavar="SHARE")  # 0.1 or 10%
SECONDS = Kind("seconds", parse=positive_seconds, check=_seconds, metavar="SECONDS")
SIZE = Kind("size", parse=size_arg, check=_positive, metavar="SIZE")  # a SIZE string
FREE_SIZE = Kind("size", parse=size_arg, check=_not_negative, metavar="SIZE")
BYTES = Kind("bytes", parse=size_arg, check=_positive, metavar="SIZE")  # a count or a SIZE
SWITCH = Kind("boolean", action=argparse.BooleanOptionalAction)  # --x / --no-x
ON = Kind("boolean", action="store_true")  # --x, off unless given


@dataclass(frozen=True)
class Crd:
    """Where a setting sits in the InferenceService's spec: ``spec.<section>.<name>``
    (``name`` defaults to the flag in camelCase), its CRD description, and OpenAPI keys
    beyond its kind's (a ``maximum``, ...)."""

    section: str  # "engine" or "memory"
    description: str | None = None
    name: str | None = None
    schema: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Setting:
    """One config field's declaration: ``flag`` (None: it has none of its own), ``kind``,
    ``help``, the ``--help`` ``group`` it is listed in, more spellings of the flag
    (``aliases``), and its ``crd`` field (None: not in the spec)."""

    flag: str | None
    kind: Kind
    help: str | None
    group: str
    aliases: tuple[str, ...] = ()
    metavar: str | None = None
    crd: Crd | None = None

    @property
    def spec_name(self) -> str | None:
        """Its name under ``spec.<section>``: the flag in camelCase unless named."""
        if self.crd is None:
            return None
        if self.crd.name is not None or self.flag is None:
            return self.crd.name
        first, *rest = self.flag.removeprefix("--").split("-")
        return first + "".join(word.capitalize() for word in rest)


def setting(default: Any, flag: str | None, kind: Kind, *, help: str | None = None,
            group: str, aliases: tuple[str, ...] = (), metavar: str | None = None,
            crd: Crd | None = None) -> Any:
    """A dataclass field declared as a setting (``MISSING``: no default)."""
    declared = Setting(flag, kind, help, group, aliases, metavar, crd)
    return field(default=default, metadata={"setting": declared})


def settings_of(config_type: type) -> Iterator[tuple[Field[Any], Setting]]:
    """Each field of a config dataclass with its declaration; a field declared without
    ``setting(...)`` is a TypeError, so it cannot be forgotten by the generators."""
    for f in fields(config_type):
        declared = f.metadata.get("setting")
        if not isinstance(declared, Setting):
            raise TypeError(f"{config_type.__name__}.{f.name} is not declared with setting(...)")
        yield f, declared


def check_settings(config: Any) -> None:
    """Each value set checked against its kind (BadInput, one line, naming the flag)."""
    for f, declared in settings_of(type(config)):
        value = getattr(config, f.name)
        if value is not None and declared.kind.check is not None:
            declared.kind.check(declared.flag or f.name, value)


def add_setting_flags(parser: argparse.ArgumentParser, config_type: type,
                      groups: dict[str, Any]) -> None:
    """A flag for each setting that has one, group by group (``--help``'s groups, made in
    the order they first appear; ``groups`` holds those made already), each group's in the
    order the fields are declared; the flag's dest is the field's name."""
    declared_flags = [(f, d) for f, d in settings_of(config_type) if d.flag is not None]
    for _, declared in declared_flags:
        if declared.group not in groups:
            groups[declared.group] = parser.add_argument_group(declared.group)
    order = list(groups)
    for f, declared in sorted(declared_flags, key=lambda fd: order.index(fd[1].group)):
        kind = declared.kind
        default = None if kind.nargs or f.default is MISSING else f.default
        options: dict[str, Any] = {"dest": f.name, "default": default, "help": declared.help}
        if kind.action is not None:
            options["action"] = kind.action
        elif kind.parse is not None:
            options["type"] = kind.parse
        elif kind.values:
            options["choices"] = kind.values
        if kind.nargs:
            options["nargs"] = kind.nargs
        if declared.metavar or kind.metavar:
            options["metavar"] = declared.metavar or kind.metavar
        groups[declared.group].add_argument(declared.flag, *declared.aliases, **options)


def values_from_args(args: argparse.Namespace, config_type: type) -> dict[str, Any]:
    """The settings parsed flags give (a list flag left out is left to its field's
    default); attributes of the namespace that are no setting are ignored."""
    values = {}
    for f, declared in settings_of(config_type):
        value = getattr(args, f.name, MISSING)
        if value is MISSING or (declared.kind.nargs and value is None):
            continue
        values[f.name] = value
    return values


def render_flags(config: Any) -> list[str]:
    """The flags that reproduce ``config`` (the inverse of the parser): each setting whose
    value is not its default, in the order the fields are declared."""
    out: list[str] = []
    for f, declared in settings_of(type(config)):
        value = getattr(config, f.name)
        if declared.flag is None or (f.default is not MISSING and value == f.default):
            continue
        if isinstance(value, bool):
            # Differs from the default: --flag for a default-off flag, --no-flag else.
            out.append(declared.flag if value else "--no-" + declared.flag[2:])
        elif declared.kind.render is not None:
            out.extend([declared.flag, *declared.kind.render(value)])
        else:
            out.extend([declared.flag, str(value)])
    return out
