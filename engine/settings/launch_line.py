"""vLLM launch lines as vLLM reads them, before argparse sees them: flag names written with
underscores (``--max_model_len``) are the dashed flags, and ``--config FILE.yaml`` is a
file of flags (``max-model-len: 4096``, ``enforce-eager: true``) that the command line
overrides. Used by the commands that take engine flags (``plan``, ``preflight``,
``serve``)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from kvledger.engine.errors import BadInput


def dashed(argv: list[str]) -> list[str]:
    """``--max_model_len=5`` -> ``--max-model-len=5`` (only a flag's name, never a value),
    and vLLM's ``-O3``, ``-O=3``, ``-O 3`` (and the older ``-O.level=3``) ->
    ``--optimization-level 3``, as vLLM's own parser rewrites them."""
    out = []
    for i, arg in enumerate(argv):
        if arg.startswith("--") and "_" in arg.split("=", 1)[0]:
            name, sep, value = arg.partition("=")
            arg = name.replace("_", "-") + sep + value
        elif arg.startswith("-O") and arg != "-O":
            out.append("--optimization-level")
            arg = arg[3:] if arg[2] == "=" else arg[2:]
        elif arg == "-O" and i + 1 < len(argv) and argv[i + 1] in ("0", "1", "2", "3"):
            arg = "--optimization-level"
        out.append(arg)
    return out


def with_config(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """``argv`` with ``--config FILE`` replaced by the file's flags, placed before the
    command line's own so that those win (argparse keeps the last value given)."""
    if "--config" not in argv:
        return argv
    if argv.count("--config") > 1:
        raise BadInput("--config is given twice: give one file")
    at = argv.index("--config")
    if at + 1 >= len(argv) or argv[at + 1].startswith("-"):
        raise BadInput("--config needs a YAML file")
    rest = argv[:at] + argv[at + 2:]
    flags = config_flags(argv[at + 1], parser)
    # A positional model stays first; the file's flags go before every other flag.
    head = 1 if rest and not rest[0].startswith("-") else 0
    return rest[:head] + flags + rest[head:]


def config_flags(path: str, parser: argparse.ArgumentParser) -> list[str]:
    """The flags a vLLM config file holds: ``key: value`` -> ``--key value``; a true
    boolean -> ``--key``, a false one -> ``--no-key`` (when the flag has that form, else
    nothing); a list -> ``--key item ...``; a mapping -> ``--key JSON``."""
    import yaml

    if Path(path).suffix not in (".yaml", ".yml"):
        raise BadInput(f"--config {path}: a config file is YAML (.yaml or .yml)")
    try:
        config: Any = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise BadInput(f"--config {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise BadInput(f"--config {path}: not UTF-8 text (byte {exc.start})") from None
    except RecursionError:
        raise BadInput(f"--config {path}: nested too deeply") from None
    except yaml.YAMLError as exc:
        raise BadInput(f"--config {path}: not valid YAML ({str(exc).splitlines()[0]})") from None
    if config is None:
        return []
    if not isinstance(config, dict):
        raise BadInput(f"--config {path}: expected a mapping of flag names to values")
    flags: list[str] = []
    for key, value in config.items():
        flag = "--" + str(key).replace("_", "-")
        if isinstance(value, bool):
            if value:
                flags.append(flag)
            elif "--no-" + flag[2:] in parser._option_string_actions:
                flags.append("--no-" + flag[2:])
        elif isinstance(value, list):
            flags += [flag, *map(str, value)] if value else []
        elif isinstance(value, dict):
            flags += [flag, json.dumps(value)]
        elif value is not None:
            flags += [flag, str(value)]
    return flags
