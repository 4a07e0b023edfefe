"""How `kvledger serve` takes each of vLLM 0.32's `vllm serve` flags: implemented (kvledger's
own flag, or read), accepted as a no-op (it changes nothing here; --help says why), or
refused by name (one error line, exit 2). Prints the counts and shares, and with
--list every flag with its verdict; then the same for vLLM's --reasoning-parser names
(served, or refused saying why).

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
    if args.list:
        for name in sorted({*REASONING_PARSERS, *REFUSED_REASONING_PARSERS}):
            print(f"{'served' if name in REASONING_PARSERS else 'refused':<12}{name}")
    served, refused = len(REASONING_PARSERS), len(REFUSED_REASONING_PARSERS)
    print(f"{served + refused} --reasoning-parser names: {served} served "
          f"({100 * served / (served + refused):.0f}%), {refused} refused")
    return 0


if __name__ == "__main__":
    sys.exit(main())
