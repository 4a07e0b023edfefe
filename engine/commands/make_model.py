"""``kvledger make-model NAME DIR``: write a small built-in checkpoint
(``model/builtin.py``): atomically, and once (the same bytes already there are left)."""

from __future__ import annotations

import argparse

from kvledger.engine.model.builtin import MODELS, install_model

HELP = "write a small built-in checkpoint"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", help=f"one of: {', '.join(MODELS)}")
    parser.add_argument("dir", help="output directory: created (or filled, if empty); one that "
                                    "already holds this very checkpoint is left as is, and "
                                    "anything else is refused unless --force")
    parser.add_argument("--force", action="store_true",
                        help="replace a DIR that holds anything else (its old contents are "
                             "removed only once the new checkpoint is complete)")


def main(args: argparse.Namespace) -> int:
    out, written = install_model(args.name, args.dir, force=args.force)
    if written:
        print(f"wrote {args.name} to {out}")
    else:
        print(f"{args.name} is already in {out} (the same bytes); nothing written")
    return 0
