"""vLLM launch lines as vLLM reads them, before argparse sees them: flag names written with
underscores (``--max_model_len``) are the dashed flags, ``--config FILE.yaml`` is a
file of flags (``max-model-len: 4096``, ``enforce-eager: true``) that the command line
overrides, and a JSON flag may be given key by key (``--kv-events-config.topic x``,
``dotted_args.py``). Used by the commands that take engine flags (``plan``,
``preflight``, ``serve``): ``vllm_argv``."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from kvledger.engine.errors import BadInput
from kvledger.engine.settings.dotted_args import merge_dotted


class LaunchLineParser(argparse.ArgumentParser):
    """Bad flags are bad input like any other: one ``error:`` line (BadInput, exit 2), no
    usage dump, pointing at ``help_command --help`` (default: the parser's ``prog``).

    No abbreviations: ``--max-num-seq 8`` must not silently mean ``--max-num-seqs``, and a
    prefix that is unique today would change meaning when a flag is added.
    """

    def __init__(self, *args, help_command: str | None = None, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        self.help_command = help_command or self.prog

    def error(self, message: str):
        raise BadInput(f"{self.prog}: {message} (see {self.help_command} --help)")


def vllm_argv(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """A launch line's arguments as argparse should see them, in vLLM's order: its
    ``--config`` file's flags in, names dashed, dotted arguments merged."""
    return merge_dotted(with_config(dashed(argv), parser))


def dashed(argv: list[str]) -> list[str]:
    """``--max_model_len=5`` -> ``--max-model-len=5`` (only a flag's name, up to its first
    '.': a dotted key such as ``--kv_events_config.enable_kv_cache_events`` keeps its
    underscores, and never a value), and vLLM's ``-O3``, ``-O=3``, ``-O 3`` ->
    ``--optimization-level 3``, as vLLM's own parser rewrites them (``-O`` followed by
    anything else too, so that ``-O 7`` is refused as a level). ``-O.KEY=VALUE`` is the
    older vLLM's, where ``-O`` was the compilation config's short flag (``-cc`` now):
    ``--compilation-config.KEY=VALUE`` (``dotted_args.py``)."""
    out = []
    for i, arg in enumerate(argv):
        if arg.startswith("--") and "_" in arg.split("=", 1)[0].split(".", 1)[0]:
            name, sep, value = arg.partition("=")
            flag, dot, keys = name.partition(".")
            arg = flag.replace("_", "-") + dot + keys + sep + value
        elif arg.startswith("-O."):
            arg = "--compilation-config" + arg[2:]
        elif arg.startswith("-O") and arg != "-O":
            out.append("--optimization-level")
            arg = arg[3:] if arg[2] == "=" else arg[2:]
        elif arg == "-O" and i + 1 < len(argv) and not argv[i + 1].startswith("-"):
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
        name, dot, keys = str(key).partition(".")  # a dotted key keeps its underscores
        flags += flag_arguments("--" + name.replace("_", "-") + dot + keys, value, parser)
    return flags


def flag_arguments(flag: str, value: Any, parser: argparse.ArgumentParser) -> list[str]:
    """One setting as the arguments of ``flag`` (a config file's key, or ``LLM``'s keyword
    argument): a true boolean -> ``--flag``, a false one -> ``--no-flag`` (when the flag has
    that form, else nothing: off is every such flag's default); a list, tuple or set ->
    ``--flag item ...``; a mapping -> ``--flag JSON``; an empty list or mapping, or None,
    -> nothing (nothing given); anything else -> ``--flag str(value)``."""
    if isinstance(value, bool):
        if value:
            return [flag]
        off = "--no-" + flag[2:]
        return [off] if off in parser._option_string_actions else []
    if value is None or (isinstance(value, list | tuple | set | frozenset | dict) and not value):
        return []
    if isinstance(value, list | tuple | set | frozenset):
        items = sorted(value, key=str) if isinstance(value, set | frozenset) else value
        return [flag, *(json.dumps(v) if isinstance(v, dict) else str(v) for v in items)]
    if isinstance(value, dict):
        return [flag, json.dumps(value)]
    return [flag, str(value)]
