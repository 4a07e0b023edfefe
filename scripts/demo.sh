#!/usr/bin/env bash
# The main job on a built-in model: write a tiny checkpoint, then `kvledger run` the
# auto-size example (validate -> pre-flight -> serve on 127.0.0.1:8000). Ctrl-C stops it.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-.venv/bin}
MODELS=/tmp/kvledger-models   # examples/*.yaml mount this folder at /models
[ -f "$MODELS/tiny-llama/config.json" ] || "$BIN/kvledger" make-model tiny-llama "$MODELS/tiny-llama"
cat <<'MSG'
Serving examples/auto-size.yaml. In another terminal:
  curl -s localhost:8000/v1/completions -H 'Content-Type: application/json' \
    -d '{"model": "tiny-llama", "prompt": "Hello", "max_tokens": 16}'
  curl -s localhost:8000/v1/budget
And a run that does not fit (exit 3, nothing loaded):
  .venv/bin/kvledger run examples/does-not-fit.yaml
MSG
exec "$BIN/kvledger" run examples/auto-size.yaml "$@"
