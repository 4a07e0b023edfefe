"""``kvledger serve``: listen at once (``/health``), plan and load, warm up (``/ready``), serve;
on SIGTERM (or Ctrl-C's SIGINT) stop admitting, let in-flight requests finish within the
grace, exit 0; a tensor-parallel rank that dies: /health 503, every request failed, exit 1.
This module is the verb (its flags, checked once); ``server/serve.py`` runs the server."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import sys

from kvledger.engine.checkpoint.hub.cache import offline_snapshot
from kvledger.engine.checkpoint.hub.uri import is_hub_uri, parse_uri
from kvledger.engine.errors import BadInput
from kvledger.engine.model.chat_template import checked_template
from kvledger.engine.server.serve import serve
from kvledger.engine.server.state import ServeOptions
from kvledger.engine.server.tenants import read_tenants_file
from kvledger.engine.server.tls import ServerTls
from kvledger.engine.settings.config_flags import add_serve_flags, config_from_args
from kvledger.engine.settings.declare import values_from_args
from kvledger.engine.settings.node_config import nodes_from_args
from kvledger.engine.settings.serve_config import ServeConfig

HELP = "plan (measured), load the model and serve HTTP"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_serve_flags(parser)  # shared with LLM's keyword arguments (settings/llm_args.py)


def main(args: argparse.Namespace) -> int:
    serving = ServeConfig(**values_from_args(args, ServeConfig))  # checked: exit 2 at once
    logging.basicConfig(level=serving.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    template = (checked_template(serving.chat_template) if serving.chat_template is not None
                else None)
    config = config_from_args(args)
    nodes = nodes_from_args(args, config.tensor_parallel_size * config.pipeline_parallel_size)
    if nodes is not None and nodes.rank > 0:  # no API here: this machine's ranks only
        from kvledger.engine.core.node_machine import run_node

        return run_node(config, nodes)
    config = dataclasses.replace(config, nodes=nodes)
    tls = ServerTls.of(serving)  # the files read and checked now, before the model loads
    if is_hub_uri(config.model):
        from huggingface_hub import constants

        if constants.is_offline_mode():
            # Not in the (read-only) cache: say so at once, before listening, not after.
            offline_snapshot(parse_uri(config.model), config.download_dir)
    api_keys = _api_keys(serving)
    tenants = read_tenants_file(serving.tenants_file) if serving.tenants_file else ()
    if serving.salt_cache_per_key and not api_keys and not any(t.keys for t in tenants):
        raise BadInput("--cache-salt-per-key needs API keys (--api-key, --api-key-file or "
                       "--tenants-file)")
    metrics_key = (serving.metrics_api_key if serving.metrics_api_key is not None
                   else os.environ.get("KVLEDGER_METRICS_API_KEY"))
    options = ServeOptions.of(serving, api_keys=api_keys, metrics_api_key=metrics_key or None,
                              chat_template=template, tenants=tenants)
    return asyncio.run(serve(config, options, tls))


API_KEY_VARIABLES = ("KVLEDGER_API_KEY", "VLLM_API_KEY")  # ours, and vLLM's (a Secret's)


def _api_keys(serving: ServeConfig) -> tuple[str, ...]:
    """--api-key's keys (else those of $KVLEDGER_API_KEY and $VLLM_API_KEY, as vLLM takes
    its variable) and --api-key-file's, in that order."""
    keys = list(serving.api_keys)
    if not keys:
        keys += [os.environ[name] for name in API_KEY_VARIABLES if os.environ.get(name)]
    if serving.api_key_file is not None:
        path = serving.api_key_file
        try:
            with open(path, encoding="utf-8") as file:
                lines = file.read().splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise BadInput(f"--api-key-file {path}: cannot read it ({exc})") from None
        from_file = [line.strip() for line in lines
                     if line.strip() and not line.lstrip().startswith("#")]
        if not from_file:
            raise BadInput(f"--api-key-file {path} holds no key")
        keys += from_file
    if any(not key.strip() for key in keys):
        raise BadInput("--api-key must not be empty")
    return tuple(dict.fromkeys(keys))


