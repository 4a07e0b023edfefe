"""``kvledger`` command line: one subcommand per module, imported lazily.

Each subcommand module exposes ``add_arguments(parser)`` and ``main(args) -> int``.
Lazy imports keep ``kvledger plan``/``preflight`` torch-free and quick to start.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from importlib.metadata import version

from kvledger.engine.errors import EXIT_BAD_INPUT, BadInput, KvledgerError
from kvledger.engine.launch_line import dashed, with_config

# name -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "plan": ("kvledger.engine.commands.plan", "print the memory budget of a declared run"),
    "preflight": ("kvledger.engine.commands.preflight",
                  "the init container: plan, write the plan JSON and a termination report"),
    "fetch": ("kvledger.engine.commands.fetch",
              "download an hf:// model's files the engine needs into the hub cache"),
    "serve": ("kvledger.engine.commands.serve", "plan (measured), load the model and serve HTTP"),
    "run": ("kvledger.operator.local_run", "run an InferenceService manifest locally, no cluster"),
    "operator": ("kvledger.operator.main", "run the kopf operator"),
    "make-model": ("kvledger.engine.commands.make_model", "write a small built-in checkpoint"),
}


# The commands that take a vLLM launch line's flags.
LAUNCH_LINE_COMMANDS = ("plan", "preflight", "fetch", "serve")


def _usage() -> str:
    lines = ["usage: kvledger COMMAND [FLAGS]", "       kvledger --version", "", "commands:"]
    lines += [f"  {name:<12} {help_text}" for name, (_, help_text) in SUBCOMMANDS.items()]
    lines += ["", "kvledger COMMAND --help shows a command's flags."]
    return "\n".join(lines)


class _OneLineErrorParser(argparse.ArgumentParser):
    """Bad flags are bad input like any other: one ``error:`` line and exit 2, no usage dump.

    No abbreviations: ``--max-num-seq 8`` must not silently mean ``--max-num-seqs``, and a
    prefix that is unique today would change meaning when a flag is added.
    """

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        raise BadInput(f"{self.prog}: {message} (see {self.prog} --help)")


def build_parser(name: str) -> argparse.ArgumentParser:
    """The parser of one subcommand; only that subcommand's module is imported."""
    module_name, help_text = SUBCOMMANDS[name]
    module = importlib.import_module(module_name)
    parser = _OneLineErrorParser(prog=f"kvledger {name}", description=help_text)
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
    if argv[0] not in SUBCOMMANDS:
        print(f"error: unknown command {argv[0]!r}\n\n{_usage()}", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        parser = build_parser(argv[0])
        flags = argv[1:]
        if argv[0] in LAUNCH_LINE_COMMANDS:  # vLLM's spellings: --max_model_len, --config
            flags = with_config(dashed(flags), parser)
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
