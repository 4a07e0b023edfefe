#!/usr/bin/env bash
# The main job on a built-in model: write a tiny checkpoint, then `kvledger run` the
# auto-size example (validate -> pre-flight -> serve on 127.0.0.1:8000, or --port N).
# Ctrl-C stops it.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-.venv/bin}
MODELS=/tmp/kvledger-models   # examples/*.yaml mount this folder at /models
# Always: a no-op when the same checkpoint is there, and a refusal (with its reason, which
# stops the demo) when the folder holds anything else, such as a half-written copy.
"$BIN/kvledger" make-model tiny-llama "$MODELS/tiny-llama"
PORT=8000   # the manifest's port; `scripts/demo.sh --port N` serves on N instead
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
    case ${args[i]} in
        --port) PORT=${args[i + 1]:-$PORT} ;;
        --port=*) PORT=${args[i]#--port=} ;;
    esac
done
cat <<MSG
Serving examples/auto-size.yaml. The built-in models have random weights: the text
they generate is gibberish by design. In another terminal:
  curl -s localhost:$PORT/v1/completions -H 'Content-Type: application/json' \\
    -d '{"model": "tiny-llama", "prompt": "Hello", "max_tokens": 16}'
  curl -s localhost:$PORT/v1/budget
And a run that does not fit (exit 3, nothing loaded):
  $BIN/kvledger run examples/does-not-fit.yaml
MSG
exec "$BIN/kvledger" run examples/auto-size.yaml "$@"
