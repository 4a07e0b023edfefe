"""docs/serving.md's table of ``kvledger serve``'s own flags, generated from their
declarations (``ServeConfig``, engine/settings/serve_config.py): each flag, its default, the
InferenceService field that sets it, and its ``--help`` line. The table sits between the
markers ``BEGIN`` and ``END`` below; tests/test_doc_figures.py fails while it is stale.

    python scripts/serve_flags_table.py            # print the table
    python scripts/serve_flags_table.py --write    # write it into docs/serving.md (make docs)
    python scripts/serve_flags_table.py --check    # exit 1 if docs/serving.md's is stale
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvledger.engine.settings.declare import add_setting_flags, default_of, settings_of
from kvledger.engine.settings.serve_config import ServeConfig

DOC = Path(__file__).resolve().parents[1] / "docs" / "serving.md"
BEGIN = "<!-- serve-flags: generated from engine/settings/serve_config.py by `make docs` -->"
END = "<!-- end of serve-flags -->"
_UNITS = [("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)]


def shown(value: object, metavar: str | None) -> str:
    """A default as a reader writes it on the command line."""
    if value is None or value in ((), {}):
        return "not set"
    if isinstance(value, bool):
        return "on" if value else "off"
    if metavar == "SIZE" and isinstance(value, int):
        for unit, size in _UNITS:
            if value % size == 0:
                return f"`{value // size}{unit}`"
    if isinstance(value, float):
        return f"`{value:g}`"
    if isinstance(value, (tuple, list)):  # a JSON list flag: as typed, not Python's repr
        return f"`{json.dumps(list(value))}`"
    return f"`{value}`"


def table() -> str:
    """The table, markers included."""
    parser = argparse.ArgumentParser()
    add_setting_flags(parser, ServeConfig, {})
    actions = {a.dest: a for a in parser._actions}
    rows = [BEGIN, "| flag | default | InferenceService | what |", "|---|---|---|---|"]
    for f, declared in settings_of(ServeConfig):
        action = actions[f.name]
        usage = parser._get_formatter()._format_action_invocation(action)
        crd = declared.crd
        field = (f"`spec.{'.'.join(filter(None, (crd.section, declared.spec_name)))}`"
                 if crd is not None else "")
        what = " ".join(parser._get_formatter()._expand_help(action).split()).replace("*", "\\*")
        cells = [f"`{usage}`", shown(default_of(f), declared.kind.metavar), field, what]
        rows.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return "\n".join([*rows, END]) + "\n"


def with_table(text: str) -> str:
    """``text`` (docs/serving.md) with its table replaced by today's."""
    start, end = text.index(BEGIN), text.index(END) + len(END) + 1
    return text[:start] + table() + text[end:]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true")
    mode.add_argument("--check", action="store_true")
    args = parser.parse_args(argv)
    if not (args.write or args.check):
        sys.stdout.write(table())
        return 0
    text = DOC.read_text(encoding="utf-8")
    if args.check:
        if with_table(text) != text:
            sys.stderr.write(f"{DOC.name}: serve's flag table is stale: make docs\n")
            return 1
        return 0
    DOC.write_text(with_table(text), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
