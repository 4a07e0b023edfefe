"""How `kvledger serve` takes each of vLLM 0.32's `vllm serve` flags: implemented (kvledger's
own flag, or read), accepted as a no-op (it changes nothing here; --help says why), or
refused by name (one error line, exit 2). Prints the counts and shares, and with
--list every flag with its verdict; then the same for vLLM's --tool-call-parser and
--reasoning-parser names (served, or refused saying why).

    .venv/bin/python scripts/vllm_flag_share.py [--list]
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter

from kvledger.engine.cli import build_parser
from kvledger.engine.settings.reasoning_parsers import (
    REASONING_PARSERS,
    REFUSED_REASONING_PARSERS,
)
from kvledger.engine.settings.tool_parsers import REFUSED_TOOL_PARSERS, TOOL_PARSERS
from kvledger.engine.settings.vllm_flags import verdicts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--list", action="store_true")
    args = parser.parse_args()
    found = verdicts(build_parser("serve"))
    if args.list:
        for flag, verdict in sorted(found.items()):
            print(f"{verdict:<12}{flag}")
    counts = Counter(found.values())
    total = sum(counts.values())
    print(f"{total} vllm serve flags: " + ", ".join(
        f"{counts[v]} {v} ({100 * counts[v] / total:.0f}%)"
        for v in ("implemented", "no-op", "refused")))
    _names("--tool-call-parser", TOOL_PARSERS, REFUSED_TOOL_PARSERS, args.list)
    _names("--reasoning-parser", REASONING_PARSERS, REFUSED_REASONING_PARSERS, args.list)
    return 0


def _names(flag: str, served: tuple[str, ...], refused: dict[str, str], listed: bool) -> None:
    """vLLM's names for ``flag``: each with its verdict (and why, when refused) if
    ``listed``, then the counts."""
    if listed:
        for name in sorted({*served, *refused}):
            print(f"{'served':<12}{name}" if name in served
                  else f"{'refused':<12}{name}: {refused[name]}")
    total = len(served) + len(refused)
    print(f"{total} {flag} names: {len(served)} served "
          f"({100 * len(served) / total:.0f}%), {len(refused)} refused")


if __name__ == "__main__":
    sys.exit(main())
