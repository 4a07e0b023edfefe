"""One declaration per setting: its flag, its kind, its help and its CRD field.

Each field of ``EngineConfig`` (``engine/settings/config.py`` composes them) and of
``ServeConfig`` (serve's own options, ``engine/settings/serve_config.py``) is declared with ``setting(...)``, which stores a
``Setting`` in the field's metadata. Everything else is generated from those
declarations: the command line's flags (``add_setting_flags``), the check of each value
(``check_settings``), a config turned back into flags for the pod (``render_flags``), and,
in the operator, the CRD's properties (``spec.engine``, ``spec.memory``, ``spec.tools`` and
serve's fields of ``spec`` itself: ``operator/api/crd_schema.py``) and the spec's mapping
onto the config (``operator/api/spec.py``). A new field is one declaration, then ``make crd``.
What a value may be is its ``Kind`` (``kinds.py``).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import MISSING, Field, dataclass, field, fields
from typing import Any

from kvledger.engine.settings.kinds import Kind


@dataclass(frozen=True)
class Crd:
    """Where a setting sits in the InferenceService's spec: ``spec.<section>.<name>``, or
    ``spec.<name>`` for the section ``""`` (``name`` defaults to the flag in camelCase), its
    CRD description, OpenAPI keys beyond its kind's (a ``maximum``, ...), and whether the
    CRD declares the field's default (``defaulted``: the API server fills it in, so a
    resource always gives it)."""

    section: str  # "engine", "memory", "tools", or "": spec's own level
    description: str | None = None
    name: str | None = None
    schema: Mapping[str, Any] = field(default_factory=dict)
    defaulted: bool = False


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
            crd: Crd | None = None, factory: Callable[[], Any] | None = None) -> Any:
    """A dataclass field declared as a setting (``MISSING``: no default; ``factory``: a
    default made afresh for each config, as a ``{}``)."""
    declared = Setting(flag, kind, help, group, aliases, metavar, crd)
    if factory is not None:
        return field(default_factory=factory, metadata={"setting": declared})
    return field(default=default, metadata={"setting": declared})


def default_of(f: Field[Any]) -> Any:
    """A field's default (made by its factory, if it has one), or ``MISSING``."""
    return f.default_factory() if f.default_factory is not MISSING else f.default


def settings_of(config_type: type) -> Iterator[tuple[Field[Any], Setting]]:
    """Each field of a config dataclass with its declaration; a field declared without
    ``setting(...)`` is a TypeError, so it cannot be forgotten by the generators."""
    for f in fields(config_type):
        declared = f.metadata.get("setting")
        if not isinstance(declared, Setting):
            raise TypeError(f"{config_type.__name__}.{f.name} is not declared with setting(...)")
        yield f, declared


def check_settings(config: Any, config_type: type | None = None) -> None:
    """Each value set checked against its kind (BadInput, one line, naming the flag): the
    settings of ``config_type`` (default: the config's own type)."""
    for f, declared in settings_of(config_type or type(config)):
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
        default = None if kind.nargs or default_of(f) is MISSING else default_of(f)
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


def render_flags(config: Any, given: Collection[str] = ()) -> list[str]:
    """The flags that reproduce ``config`` (the inverse of the parser): each setting whose
    value is not its default, in the order the fields are declared. A setting named in
    ``given`` (a resource set it) is passed on at its default too, so the pod runs what
    the resource says whatever serve's default; a switch only when it differs (an on-only
    flag has no spelling for off); None, never (not set)."""
    out: list[str] = []
    for f, declared in settings_of(type(config)):
        value = getattr(config, f.name)
        at_default = value == default_of(f)
        if (declared.flag is None or value is None
                or (at_default and (f.name not in given or isinstance(value, bool)))):
            continue
        if isinstance(value, bool):
            # Differs from the default: --flag for a default-off flag, --no-flag else.
            out.append(declared.flag if value else "--no-" + declared.flag[2:])
        elif declared.kind.render is not None:
            out.extend([declared.flag, *declared.kind.render(value)])
        else:
            out.extend([declared.flag, str(value)])
    return out
