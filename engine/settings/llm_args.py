"""``LLM(model, **engine_args)``'s keyword arguments read as ``kvledger serve`` reads its
flags, so a script written for vLLM's ``LLM`` ports as its launch line does.

Each keyword is vLLM's engine-argument name of a flag (``max_model_len`` is
``--max-model-len``, as vLLM derives its flags from ``EngineArgs``' fields), and is read
by ``kvledger serve``'s own parser (``add_serve_flags``) and ``config_from_args``:

- kvledger's engine settings (``EngineConfig``'s fields, by field or flag name) keep their
  Python values, checked by the setting's kind as the flag's are (vLLM's ``LLM`` takes an
  int, so ``max_model_len="1k"`` is refused where ``--max-model-len 1k`` is 1,000); a dict
  is the flag's JSON, read by the flag's reader (``kv_events_config={...}``); a list's
  text items by the flag's item reader (``lora_modules=["name=path"]``).
- vLLM's other flags become their arguments (``launch_line.flag_arguments``: True ->
  ``--flag``, False -> ``--no-flag``, a dict -> its JSON, a list -> its items; None is not
  given, as is an empty text, vLLM's default of its text arguments) and go through ``vllm_rules.RULES`` as on the command line: read
  (``revision``, ``compilation_config``, ``optimization_level``), accepted as changing
  nothing, or refused with the flag's one line. ``compilation_config`` may be an int, as
  vLLM's ``LLM`` takes it: its ``mode``, which tunes torch.compile.
- A flag of the HTTP server's (``ServeConfig``'s, the multi-node ones) is BadInput saying
  it belongs to ``kvledger serve``; a name that is no flag at all is BadInput too.

``LLM`` reads ``structured_outputs_config`` and ``chat_template`` itself (they are
serve's flags, but vLLM's ``LLM`` takes them as its own).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from dataclasses import fields
from typing import Any

from kvledger.engine.errors import BadInput
from kvledger.engine.settings.config import EngineConfig
from kvledger.engine.settings.config_flags import add_serve_flags, config_from_args
from kvledger.engine.settings.declare import settings_of
from kvledger.engine.settings.kinds import Kind
from kvledger.engine.settings.launch_line import LaunchLineParser, flag_arguments, vllm_argv
from kvledger.engine.settings.serve_config import ServeConfig
from kvledger.engine.settings.vllm_flags import vllm_dest

_COMPILATION_MODES = (0, 1, 2, 3)  # vLLM's CompilationMode: NONE .. VLLM_COMPILE
# serve's settings by field name -> flag (``api_keys`` -> ``--api-key``)
_SERVE_FIELDS = {f.name: str(declared.flag) for f, declared in settings_of(ServeConfig)}


def config_from_kwargs(model: str, kwargs: Mapping[str, Any]) -> EngineConfig:
    """The engine config ``LLM(model, **kwargs)`` runs, built as ``kvledger serve MODEL
    FLAGS`` builds it; BadInput, one line, for a name or value its flag refuses."""
    parser = _parser()
    typed: dict[str, Any] = {}
    argv = [str(model)]
    for name, value in kwargs.items():
        if value is None:  # vLLM's "not given": the setting's default
            continue
        field = _engine_fields().get(name) or _engine_dest(parser, name)
        if field is not None:
            typed[field] = _engine_value(field, value)
            continue
        flag = _flag(parser, name)
        if isinstance(value, str) and not value:  # vLLM's text defaults: "" is not given
            continue
        if name == "compilation_config" and isinstance(value, int) and not isinstance(value, bool):
            value = _compilation_mode(value)
        argv += flag_arguments(flag, value, parser)
    try:
        args = parser.parse_args(vllm_argv(argv, parser))
        for field, value in typed.items():
            setattr(args, field, value)
        return config_from_args(args)
    except BadInput as exc:  # the parser's own errors name it (prog) already
        raise BadInput(str(exc) if str(exc).startswith("LLM") else f"LLM: {exc}") from None


@functools.cache
def _parser() -> LaunchLineParser:
    parser = LaunchLineParser(prog="LLM", help_command="kvledger serve")
    add_serve_flags(parser)
    return parser


@functools.cache
def _engine_fields() -> dict[str, str]:
    """EngineConfig's settings by field name and by flag name (``memory_limit_bytes`` and
    ``memory_limit``) -> field name."""
    out = {f.name: f.name for f in fields(EngineConfig)}
    for f, declared in settings_of(EngineConfig):
        for flag in (declared.flag, *declared.aliases):
            if flag is not None:
                out.setdefault(flag[2:].replace("-", "_"), f.name)
    return out


def _engine_dest(parser: LaunchLineParser, name: str) -> str | None:
    action = parser._option_string_actions.get(_dashed(name))
    return action.dest if action is not None and action.dest in _engine_fields() else None


def _flag(parser: LaunchLineParser, name: str) -> str:
    """The vLLM flag ``name`` is; BadInput for a name that is none, or one of serve's."""
    flag = _dashed(name)
    action = parser._option_string_actions.get(flag)
    if name in _SERVE_FIELDS or (action is not None and action.dest != "help"
                                 and action.dest != vllm_dest(action.option_strings[0])):
        # Defined by serve itself (ServeConfig, the machines), not by a vLLM rule.
        shown = _SERVE_FIELDS.get(name) or action.option_strings[0]
        raise BadInput(f"LLM: {name} is {shown}, a flag of `kvledger serve` (the HTTP server "
                       "or its machines), not of the engine: give it to kvledger serve")
    if name == "config":  # its file's serve flags would slip past the check above
        raise BadInput("LLM: config is --config, a YAML file of command-line flags: pass its "
                       "keys as keyword arguments")
    if action is None or action.dest == "help":
        raise BadInput(f"LLM: unknown engine argument {name!r}: not one of vLLM 0.32's engine "
                       "arguments nor a kvledger engine flag (docs/serving.md)")
    return flag


def _dashed(name: str) -> str:
    return "--" + name.replace("_", "-")


def _engine_value(field: str, value: Any) -> Any:
    """A setting's Python value; a dict read by the flag's JSON reader, a list's text items
    by the flag's item reader (as the command line reads them)."""
    kind = _kinds()[field]
    if kind is None or kind.parse is None:
        return value
    if isinstance(value, Mapping):
        return kind.parse(json.dumps(value))
    if kind.nargs and isinstance(value, list | tuple):
        return [kind.parse(v) if isinstance(v, str) else v for v in value]
    return value


@functools.cache
def _kinds() -> dict[str, Kind | None]:
    return {f.name: declared.kind for f, declared in settings_of(EngineConfig)}


def _compilation_mode(mode: int) -> dict[str, int]:
    """vLLM's ``LLM(compilation_config=N)``: ``CompilationConfig(mode=N)``."""
    if mode not in _COMPILATION_MODES:
        raise BadInput(f"LLM: compilation_config={mode}: vLLM's compilation modes are 0, 1, "
                       "2 and 3 (they tune torch.compile, which kvledger does not run)")
    return {"mode": mode}

