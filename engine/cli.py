"""``kvledger`` command line: one subcommand per module, imported lazily.

Each subcommand module exposes ``HELP`` (one line), ``add_arguments(parser)`` and
``main(args) -> int``. Lazy imports keep ``kvledger plan``/``preflight`` torch-free and
quick to start. The engine's own commands are listed here; another package registers its
own as entry points of the group ``kvledger.commands`` (name = its module), as the
operator does ``run`` and ``operator`` (pyproject.toml): the engine never imports it.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import os
import sys
from importlib.metadata import entry_points, version

from kvledger.engine.errors import EXIT_BAD_INPUT, KvledgerError
from kvledger.engine.settings.launch_line import LaunchLineParser, vllm_argv

# The engine's own commands: name -> module.
ENGINE_COMMANDS: dict[str, str] = {
    "plan": "kvledger.engine.commands.plan",
    "preflight": "kvledger.engine.commands.preflight",
    "fetch": "kvledger.engine.commands.fetch",
    "serve": "kvledger.engine.commands.serve",
    "make-model": "kvledger.engine.commands.make_model",
}
COMMANDS_GROUP = "kvledger.commands"  # the entry points other packages register under


@functools.cache
def commands() -> dict[str, str]:
    """Every command: the engine's, then those registered as entry points (none where
    kvledger runs from a source tree that is not installed)."""
    registered = {ep.name: ep.value for ep in entry_points(group=COMMANDS_GROUP)}
    return {**ENGINE_COMMANDS, **{n: m for n, m in registered.items() if n not in ENGINE_COMMANDS}}


# The commands that take a vLLM launch line's flags.
LAUNCH_LINE_COMMANDS = ("plan", "preflight", "fetch", "serve")


def _usage() -> str:
    lines = ["usage: kvledger COMMAND [FLAGS]", "       kvledger --version", "", "commands:"]
    lines += [f"  {name:<12} {importlib.import_module(module).HELP}"
              for name, module in commands().items()]
    lines += ["", "kvledger COMMAND --help shows a command's flags."]
    return "\n".join(lines)


def build_parser(name: str) -> argparse.ArgumentParser:
    """The parser of one subcommand; only that subcommand's module is imported."""
    module = importlib.import_module(commands()[name])
    parser = LaunchLineParser(prog=f"kvledger {name}", description=module.HELP)
    module.add_arguments(parser)
    parser.set_defaults(_module=module)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else EXIT_BAD_INPUT
    if argv == ["--version"]:
        # The installed distribution's version (pyproject.toml), as GET /version serves it.
        print(f"kvledger {version('kvledger')}")
        return 0
    if argv[0] not in commands():
        print(f"error: unknown command {argv[0]!r}\n\n{_usage()}", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        parser = build_parser(argv[0])
        flags = argv[1:]
        if argv[0] in LAUNCH_LINE_COMMANDS:  # vLLM's: --max_model_len, --config, --x.key
            flags = vllm_argv(flags, parser)
        args = parser.parse_args(flags)
        return int(args._module.main(args) or 0)
    except KvledgerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader went away (`kvledger plan --json | head`): no traceback, and keep
        # Python's exit-time flush from raising again on the closed pipe.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
