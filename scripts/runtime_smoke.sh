#!/usr/bin/env bash
# Runtime smoke test of a plain install: every CLI verb once, with only the declared
# dependencies (`pip install .`, no extras, not editable), from a scratch folder outside
# the repository so nothing is imported from the source tree.
#
#   python3 -m venv /tmp/rt && /tmp/rt/bin/pip install torch==2.13.0 \
#       && /tmp/rt/bin/pip install .
#   scripts/runtime_smoke.sh /tmp/rt/bin
#
# Any deviation (exit code, missing output, a traceback, torch's NumPy warning) stops it
# with a FAIL line naming the step and the command's output.
set -euo pipefail

BIN=$(cd "${1:?usage: scripts/runtime_smoke.sh VENV_BIN_DIR}" && pwd)
REPO=$(cd "$(dirname "$0")/.." && pwd)
KV=$BIN/kvledger
PY=$BIN/python
[ -x "$KV" ] || { echo "FAIL: no kvledger in $BIN: pip install . into that venv first" >&2; exit 1; }

WORK=$(mktemp -d "${TMPDIR:-/tmp}/kvledger-smoke.XXXXXX")
SERVER_PID=
cleanup() {
    if [ -n "$SERVER_PID" ]; then kill -9 "$SERVER_PID" 2>/dev/null || true; fi
    rm -rf "$WORK"
}
trap cleanup EXIT
cd "$WORK"

fail() {
    echo "FAIL: $*" >&2
    exit 1
}

show() {  # the tail of a step's output files, indented
    for f in "$@"; do
        if [ -s "$f" ]; then echo "  $f:" >&2; tail -n 25 "$f" | sed 's/^/  | /' >&2; fi
    done
}

clean() {  # clean NAME FILE...: no traceback, no missing module, no NumPy warning
    local name=$1
    shift
    if grep -E -l "Traceback|ModuleNotFoundError|Failed to initialize NumPy" "$@" >/dev/null; then
        show "$@"
        fail "$name: a traceback or a missing-dependency warning"
    fi
}

expect() {  # expect CODE NAME CMD...: CMD must exit CODE; its output goes to NAME.out/.err
    local want=$1 name=$2 got=0
    shift 2
    timeout 300 "$@" >"$name.out" 2>"$name.err" || got=$?
    if [ "$got" != "$want" ]; then
        show "$name.out" "$name.err"
        fail "$name: exit $got, expected $want: ${*#"$BIN/"}"
    fi
    clean "$name" "$name.out" "$name.err"
    echo "ok  $name (exit $got)"
}

contains() {  # contains FILE TEXT: FILE holds the fixed string TEXT
    grep -qF -- "$2" "$1" || { show "$1"; fail "$1 lacks: $2"; }
}

# The installed package, not the source tree (an editable install would hide a file
# missing from the wheel).
# (The venv itself may live inside the repository, as CI's .venv-runtime does.)
where=$("$PY" -c 'import kvledger.engine as e, kvledger.operator as o; print(*e.__path__, *o.__path__)')
case "$where" in
    *"$REPO/engine"*|*"$REPO/operator"*) fail "kvledger is imported from the repository ($where): install it with a plain 'pip install .'" ;;
esac

MODEL=$WORK/models/tiny-llama

expect 0 help "$KV" --help
contains help.out "make-model"

expect 0 make-model "$KV" make-model tiny-llama "$MODEL"
for f in config.json model.safetensors tokenizer.json tokenizer_config.json generation_config.json; do
    [ -s "$MODEL/$f" ] || fail "make-model wrote no $MODEL/$f"
done
expect 0 make-model-again "$KV" make-model tiny-llama "$MODEL"
contains make-model-again.out "nothing written"

expect 0 plan "$KV" plan --model "$MODEL" --device-memory 8GiB --max-model-len 256
contains plan.out "fits: engine requires"
expect 3 plan-refused "$KV" plan --model "$MODEL" --device-memory 8GiB --memory-limit 64MiB
contains plan-refused.err "error: engine requires"

expect 0 preflight "$KV" preflight --model "$MODEL" --device-memory 8GiB --max-model-len 256 \
    --plan-out "$WORK/pod/plan.json" --termination-log "$WORK/pod/termination-log"
"$PY" -c 'import json, sys; assert json.load(open(sys.argv[1]))["fits"] is True' \
    "$WORK/pod/plan.json" || fail "preflight: --plan-out is not a plan JSON that fits"
contains "$WORK/pod/termination-log" "fits: engine requires"

# A hub model with the hub unreachable (nothing listens on the port): huggingface_hub is
# installed, and the bounded retries end in one line, exit 2.
DEAD=$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
expect 2 fetch-unreachable env HF_ENDPOINT="http://127.0.0.1:$DEAD" HF_HOME="$WORK/hf-home" \
    "$KV" fetch --model hf://kvledger/none --download-dir "$WORK/hub-cache"
if [ "$(wc -l <fetch-unreachable.err)" != 1 ] || ! grep -q "^error: .*cannot reach the hub" fetch-unreachable.err; then
    show fetch-unreachable.err
    fail "fetch-unreachable: not a one-line 'cannot reach the hub' error"
fi

cat >service.yaml <<EOF
apiVersion: kvledger.dev/v1alpha1
kind: InferenceService
metadata:
  name: smoke
spec:
  model:
    path: /models/tiny-llama
    name: tiny-llama
    volume:
      hostPath:
        path: $WORK/models
      mountPath: /models
  engine:
    maxModelLen: 256
    maxNumSeqs: 2
  gpus: 0
  resources:
    limits:
      memory: 2Gi
EOF
expect 0 run-preflight-only "$KV" run service.yaml --preflight-only
contains run-preflight-only.out "smoke: pre-flight passed"
contains run-preflight-only.out "host memory (container limit), 2.0 GiB total"

PORT=$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
"$KV" serve --model "$MODEL" --served-model-name tiny-llama --device cpu --host 127.0.0.1 \
    --port "$PORT" --max-model-len 256 --max-num-seqs 2 >serve.log 2>&1 &
SERVER_PID=$!
if ! "$PY" - "$PORT" "$SERVER_PID" <<'EOF'; then
import json, os, sys, time, urllib.error, urllib.request

port, pid = int(sys.argv[1]), int(sys.argv[2])
base = f"http://127.0.0.1:{port}"
deadline = time.monotonic() + 180
while True:
    try:
        with urllib.request.urlopen(base + "/ready", timeout=2) as r:
            if r.status == 200:
                break
    except OSError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        sys.exit("serve exited before /ready answered 200")
    if time.monotonic() > deadline:
        sys.exit("serve: /ready did not answer 200 within 180 s")
    time.sleep(0.2)


def post(path, body, what):
    request = urllib.request.Request(base + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return json.load(r)
    except urllib.error.HTTPError as exc:
        sys.exit(f"serve: the {what} answered {exc.code}: {exc.read()[:500]!r}")


answer = post("/v1/completions", {"model": "tiny-llama", "prompt": "Hello", "max_tokens": 8},
              "completion")
if answer["usage"]["completion_tokens"] != 8:
    sys.exit(f"serve: the completion did not return 8 tokens: {answer}")
# Structured output and logprobs: the grammar library and pydantic are runtime deps.
answer = post("/v1/chat/completions",
              {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}],
               "max_tokens": 64, "logprobs": True, "top_logprobs": 2,
               "response_format": {"type": "json_object"}}, "json_object chat")
choice = answer["choices"][0]
if choice["finish_reason"] == "stop":
    json.loads(choice["message"]["content"])
if len(choice["logprobs"]["content"]) != answer["usage"]["completion_tokens"]:
    sys.exit(f"serve: the chat's logprobs do not match its tokens: {answer}")
EOF
    show serve.log
    fail "serve: not ready, or the completion failed"
fi
echo "ok  serve (/ready 200, completion 200, json_object chat with logprobs 200)"
kill -TERM "$SERVER_PID"
code=0
wait "$SERVER_PID" || code=$?
SERVER_PID=
[ "$code" = 0 ] || { show serve.log; fail "serve: exit $code after SIGTERM, expected 0"; }
contains serve.log "SIGTERM: draining"
clean serve serve.log
echo "ok  serve-sigterm (exit 0)"

if [ -e /var/run/secrets/kubernetes.io/serviceaccount/token ]; then
    echo "skip operator: this runs in a pod, whose service account would log in"
else
    mkdir empty-home
    expect 2 operator env KUBECONFIG="$WORK/no-such-kubeconfig" HOME="$WORK/empty-home" \
        "$KV" operator
    if [ "$(wc -l <operator.err)" != 1 ] || ! grep -q "^error: " operator.err; then
        show operator.err
        fail "operator: not a one-line 'error:' message"
    fi
    [ ! -s operator.out ] || { show operator.out; fail "operator: wrote to stdout"; }
fi
# The admission webhook's modules and its self-signed certificate (cryptography), as the
# operator loads them with --webhook-port.
expect 0 webhook-certificate "$PY" -c 'from kvledger.operator.cluster import certs
from kvledger.operator.webhook import webhook
pair = certs.make_pair(certs.dns_names("kvledger-webhook", "kvledger-system"))
assert certs.still_good(pair, certs.dns_names("kvledger-webhook", "kvledger-system"))'

echo "runtime smoke test passed: every kvledger command runs from a plain install"
