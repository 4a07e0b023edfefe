"""The engine's settings from a command line: ``add_engine_flags`` (shared by ``plan``,
``preflight``, ``serve`` and ``run``, so the operator can hand the init container and the
engine container the same argument list), ``add_serve_flags`` (serve's, which ``LLM`` reads its
keyword arguments with) and ``config_from_args``, which reads vLLM's
positional MODEL and ``--model`` as one setting."""

from __future__ import annotations

import argparse

from kvledger.engine.checkpoint.hub.uri import model_reference, with_revision
from kvledger.engine.errors import BadInput
from kvledger.engine.settings.compilation_config import graph_settings
from kvledger.engine.settings.config import EngineConfig
from kvledger.engine.settings.config_values import WORKLOAD
from kvledger.engine.settings.declare import add_setting_flags, values_from_args
from kvledger.engine.settings.node_config import add_node_flags
from kvledger.engine.settings.serve_config import ServeConfig
from kvledger.engine.settings.vllm_flags import add_vllm_flags, vllm_dest


def add_engine_flags(parser: argparse.ArgumentParser,
                     config_type: type[EngineConfig] = EngineConfig) -> None:
    """The flags shared by plan/preflight/serve, named as vLLM names them: ``vllm serve``'s
    positional MODEL, then one flag per setting of ``config_type`` (a subclass adds its own)."""
    workload = parser.add_argument_group(WORKLOAD)
    workload.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                          help="the model, as `vllm serve MODEL` takes it: the same as --model")
    add_setting_flags(parser, config_type, {WORKLOAD: workload})


def add_serve_flags(parser: argparse.ArgumentParser) -> None:
    """``kvledger serve``'s flags (``LLM`` reads its keyword arguments with them too): the
    engine's, vLLM's multi-node ones, serve's own (one per ``ServeConfig`` field: the
    "server" and "the OpenAI API" groups), then vLLM's others."""
    add_engine_flags(parser)
    add_node_flags(parser)
    add_setting_flags(parser, ServeConfig, {})
    add_vllm_flags(parser)


def config_from_args(args: argparse.Namespace,
                     config_type: type[EngineConfig] = EngineConfig) -> EngineConfig:
    """Build the config from parsed flags, with the vLLM flags read rather than defined
    (``--revision``, ``-O``, ``--compilation-config``: ``vllm_rules.py``) applied; other
    namespace attributes are ignored."""
    values = values_from_args(args, config_type)
    given = _model(getattr(args, "model_tag", None), getattr(args, "model", None))
    values["model"] = model_reference(given) if given else given
    revision = getattr(args, vllm_dest("--revision"), None)
    if revision is not None and given:
        values["model"] = with_revision(values["model"], revision)
    values.update(graph_settings(values, getattr(args, vllm_dest("--optimization-level"), None),
                                 getattr(args, vllm_dest("--compilation-config"), None)))
    if values["model"] != given and not values.get("served_model_name"):
        values["served_model_name"] = [given]  # requests name it as launched, as in vLLM
    names = values.get("served_model_name")
    if isinstance(names, list):  # --served-model-name NAME [NAME ...]
        values["served_model_name"], values["served_model_aliases"] = names[0], tuple(names[1:])
    return config_type(**values)


def _model(positional: str | None, flag: str | None) -> str | None:
    """``vllm serve MODEL`` and ``--model MODEL`` are one setting; two different models is
    a launch line that means two things, so it is refused rather than one picked."""
    if positional and flag and positional != flag:
        raise BadInput(f"the model is given twice, {positional!r} and --model {flag!r}: "
                       "give one")
    return positional or flag
