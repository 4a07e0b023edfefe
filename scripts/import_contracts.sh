#!/usr/bin/env bash
# The import contracts of pyproject.toml's [tool.importlinter] (lint-imports, from the test
# extras): imports only go down the engine's rooms, no cycles inside a room, the planner
# and checkpoint/ torch-free, the operator free of torch and of the engine's torch rooms.
# The folders engine/ and operator/ are the packages kvledger.engine and kvledger.operator
# through setuptools' package-dir, which import-linter's graph builder does not follow: it
# reads a tree where kvledger/ holds them as real folders (symbolic links).
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-.venv/bin}
TREE=$(mktemp -d)
trap 'rm -rf "$TREE"' EXIT
mkdir "$TREE/kvledger"
ln -s "$PWD/engine" "$TREE/kvledger/engine"
ln -s "$PWD/operator" "$TREE/kvledger/operator"
PYTHONPATH="$TREE" "$BIN/lint-imports" --no-cache
