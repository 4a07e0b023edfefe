#!/usr/bin/env bash
# A request arriving at zero replicas, answered after a pod starts: a kind cluster with
# KEDA, KEDA's HTTP add-on and kvledger's chart, examples/scale-to-zero.yaml (the built-in
# tiny-llama on the CPU), the wait measured. Needs the internet (charts, images, a CPU
# torch for the image), kind, kubectl, helm 3+ and docker or podman; not run by CI, and
# not yet run on the development machine, where no cluster can be had (no Go toolchain,
# no image registry): docs/operator.md, "Scaling", says what it checks.
#
#     bash bench/scale_to_zero_kind.sh            # about 10 minutes, most of it installing
#     KEEP=1 bash bench/scale_to_zero_kind.sh     # leave the cluster up afterwards
#
# 1. kind: a control plane and one worker (the operator keeps engine pods off control-plane
#    nodes), the worker mounting a folder of this machine where `kvledger make-model`
#    wrote tiny-llama, at /tmp/kvledger-models as the example's hostPath says.
# 2. The CPU image (the Dockerfile, Debian's Python, PyPI's CPU torch), loaded into kind.
# 3. KEDA ($KEDA_VERSION), its HTTP add-on (chart keda-add-ons-http, $HTTP_ADDON_VERSION;
#    v0.15 or later) and kvledger's chart (policy.hostPaths allowing the model's folder).
# 4. The example applied and scaled to 0 at once (KEDA would after its 5-minute cooldown),
#    its pods gone.
# 5. hold: one completion sent to the interceptor (`Host:` the example's), timed until its
#    answer; then status.startup, what the operator measured of the pod that woke.
# 6. retryAfter: the example with `coldStart: retryAfter`, scaled to 0 again: the first
#    request must be answered 503 at once with Retry-After = status.startup.seconds.total,
#    and a request retried every second after it must get 200 once a pod is ready.
# Claims (exit 1 with a line each when one fails): (5) answered 200 with a completion, the
# wait no shorter than the pod's start and at most $SLACK_S seconds longer; (6) the 503's
# Retry-After as said, sent within 2 s, and a 200 within readinessTimeout. The figures go
# to $RESULT (JSON): commit it under bench/results/.
set -euo pipefail
cd "$(dirname "$0")/.."
CLUSTER=${CLUSTER:-kvledger-zero}
KEDA_VERSION=${KEDA_VERSION:-2.20.1}
HTTP_ADDON_VERSION=${HTTP_ADDON_VERSION:-}   # empty: the chart's newest
IMAGE=${IMAGE:-localhost/kvledger:zero}
SLACK_S=${SLACK_S:-30}
SETTLE_S=${SETTLE_S:-5}  # for the port-forward, and for a status or route the operator rewrites
RESULT=${RESULT:-bench/results/scale_to_zero-kind.json}
KEEP=${KEEP:-0}
NAME=tiny-zero
HOST=$NAME.default.svc.cluster.local
PATH="$PATH:$PWD/.tools/bin"  # helm and kubectl where `make test` put them, if none before

for tool in kind kubectl helm curl python3; do
  command -v "$tool" >/dev/null || { echo "scale_to_zero_kind: $tool is not on PATH" >&2; exit 2; }
done
if command -v docker >/dev/null; then ENGINE=docker
elif command -v podman >/dev/null; then ENGINE=podman; export KIND_EXPERIMENTAL_PROVIDER=podman
else echo "scale_to_zero_kind: neither docker nor podman" >&2; exit 2; fi
KVLEDGER=${KVLEDGER:-.venv/bin/kvledger}
[ -x "$KVLEDGER" ] || { echo "scale_to_zero_kind: no $KVLEDGER (make install)" >&2; exit 2; }

WORK=$(mktemp -d)
FORWARD=""
finish() {
  [ -n "$FORWARD" ] && kill "$FORWARD" 2>/dev/null || true
  if [ "$KEEP" = 1 ]; then echo "cluster $CLUSTER kept (kind delete cluster --name $CLUSTER)"
  else kind delete cluster --name "$CLUSTER" >/dev/null 2>&1 || true; fi
  rm -rf "$WORK"
}
trap finish EXIT
say() { echo "[$(date +%T)] $*"; }

say "1. the model and the cluster"
MODELS="$WORK/models"
"$KVLEDGER" make-model tiny-llama "$MODELS/tiny-llama" >/dev/null
cat > "$WORK/kind.yaml" <<EOF
kind: Cluster
apiVersion: kind.x-k8s.io/v1alpha4
nodes:
  - role: control-plane
  - role: worker
    extraMounts:
      - hostPath: $MODELS
        containerPath: /tmp/kvledger-models
        readOnly: true
EOF
kind create cluster --name "$CLUSTER" --config "$WORK/kind.yaml" --wait 120s

say "2. the CPU image"
"$ENGINE" build -q -t "$IMAGE" --build-arg BASE=docker.io/library/debian:bookworm-slim \
  --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu .
"$ENGINE" save -o "$WORK/image.tar" "$IMAGE"
kind load image-archive "$WORK/image.tar" --name "$CLUSTER"
rm -f "$WORK/image.tar"

say "3. KEDA, its HTTP add-on, kvledger"
helm repo add kedacore https://kedacore.github.io/charts --force-update >/dev/null
helm upgrade --install keda kedacore/keda --namespace keda --create-namespace \
  --version "$KEDA_VERSION" --wait --timeout 5m
helm upgrade --install http-add-on kedacore/keda-add-ons-http --namespace keda \
  ${HTTP_ADDON_VERSION:+--version "$HTTP_ADDON_VERSION"} --wait --timeout 5m
kubectl get crd interceptorroutes.http.keda.sh >/dev/null \
  || { echo "scale_to_zero_kind: the add-on serves no InterceptorRoute (v0.15 or later needed)" >&2; exit 2; }
helm upgrade --install kvledger charts/kvledger --namespace kvledger-system --create-namespace \
  --set image.repository="${IMAGE%:*}" --set image.tag="${IMAGE##*:}" \
  --set 'policy.hostPaths={/tmp/kvledger-models}' --wait --timeout 5m

count_pods() {
  kubectl get pods -l "kvledger.dev/inferenceservice=$NAME" -o name 2>/dev/null | wc -l
}
to_zero() {  # scale the resource to 0 and wait until no pod of it is left
  kubectl scale "kvis/$NAME" --replicas 0
  for _ in $(seq 300); do [ "$(count_pods)" = 0 ] && return 0; sleep 1; done
  echo "scale_to_zero_kind: pods still there 5 minutes after scaling to 0" >&2; exit 1
}
startup() {  # startup FILE: status.startup, the start the operator last measured
  kubectl get "kvis/$NAME" -o jsonpath='{.status.startup}' >"$WORK/$1"
}

say "4. the example, at zero"
kubectl apply -f examples/scale-to-zero.yaml
to_zero
kubectl -n keda port-forward svc/keda-add-ons-http-interceptor-proxy 18080:8080 \
  >"$WORK/forward.log" 2>&1 &
FORWARD=$!
sleep "$SETTLE_S"
REQUEST='{"model": "tiny-llama", "prompt": "Hello", "max_tokens": 8}'
post() {  # post OUTFILE: status code, then the seconds it took, on one line
  curl -s -o "$1" -D "$1.headers" -w '%{http_code} %{time_total}\n' --max-time 600 \
    -H "Host: $HOST" -H 'Content-Type: application/json' -d "$REQUEST" \
    http://127.0.0.1:18080/v1/completions || echo "000 0"
}

say "5. hold: a request at zero replicas"
pods_before=$(count_pods)
read -r held_code held_s < <(post "$WORK/held.json")
sleep "$SETTLE_S"  # the operator's next status of the pod that woke
startup held_start.json

say "6. retryAfter: told, then answered"
kubectl patch "kvis/$NAME" --type merge \
  -p '{"spec": {"autoscaling": {"httpAddOn": {"coldStart": "retryAfter", "readinessTimeout": null}}}}'
to_zero
sleep "$SETTLE_S"  # the route's placeholder, rewritten at the operator's reconcile
startup told_start.json
read -r told_code told_s < <(post "$WORK/told.json")
began=$(date +%s.%N)
retry_code=000
for _ in $(seq 300); do
  read -r retry_code _ < <(post "$WORK/retry.json")
  [ "$retry_code" = 200 ] && break
  sleep 1
done
retry_s=$(python3 -c "import time; print(round(time.time() - $began, 3))")

python3 - "$WORK" "$RESULT" "$SLACK_S" <<EOF
import json, sys
from pathlib import Path
work, result, slack = Path(sys.argv[1]), Path(sys.argv[2]), float(sys.argv[3])
def body(name):
    try:
        return json.loads((work / name).read_text())
    except (OSError, ValueError):
        return None
def header(name, key):
    for line in (work / f"{name}.headers").read_text().splitlines():
        k, _, v = line.partition(":")
        if k.strip().lower() == key.lower():
            return v.strip()
    return None
held_start, told_start = body("held_start.json"), body("told_start.json")
report = {"pods_before": int("$pods_before"),
          "hold": {"status": int("$held_code"), "seconds": float("$held_s"),
                   "answer": body("held.json"), "startup": held_start},
          "retryAfter": {"status": int("$told_code"), "seconds": float("$told_s"),
                         "retry_after": header("told.json", "Retry-After"),
                         "answer": body("told.json"), "startup": told_start,
                         "answered_after_s": float("$retry_s"),
                         "answered_status": int("$retry_code")}}
result.parent.mkdir(parents=True, exist_ok=True)
result.write_text(json.dumps(report, indent=1) + "\n")
print(json.dumps(report, indent=1))
failures = []
hold = report["hold"]
pod_start = ((hold["startup"] or {}).get("seconds") or {}).get("total")
if report["pods_before"] != 0:
    failures.append(f"{report['pods_before']} pods when the request was sent, not 0")
if hold["status"] != 200 or not (hold["answer"] or {}).get("choices"):
    failures.append(f"hold: answered {hold['status']}, not 200 with a completion")
elif pod_start is None:
    failures.append("hold: the operator measured no start (status.startup)")
elif not pod_start - 1 <= hold["seconds"] <= pod_start + slack:  # whole seconds
    failures.append(f"hold: waited {hold['seconds']:.1f} s for a pod that started in "
                    f"{pod_start:.1f} s (at most {slack:.0f} s more allowed)")
told = report["retryAfter"]
want = ((told["startup"] or {}).get("seconds") or {}).get("total")
if told["status"] != 503 or told["seconds"] > 2:
    failures.append(f"retryAfter: answered {told['status']} in {told['seconds']:.1f} s, "
                    f"not 503 at once")
elif want is not None and told["retry_after"] != str(round(want)):
    failures.append(f"retryAfter: Retry-After {told['retry_after']}, the start was {want} s")
if told["answered_status"] != 200:
    failures.append(f"retryAfter: no 200 within 300 retries ({told['answered_status']})")
for line in failures:
    print("FAILED:", line)
sys.exit(1 if failures else 0)
EOF
