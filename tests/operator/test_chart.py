"""The chart's values: values.schema.json refuses unknown keys, wrong types and enums with
a message naming the value, the monitors are off by default and never both on, and the
Grafana dashboard's ConfigMap carries dashboards/kvledger.json. Runs ``helm template``
(scripts/helm_check.sh installs helm into .tools/; skipped where there is no helm)."""

from __future__ import annotations

import json

import pytest
from chart_harness import CHART, HELM, by_kind, helm_template
from spec_helpers import spec_of

pytestmark = pytest.mark.skipif(HELM is None, reason="helm is not installed "
                                "(bash scripts/helm_check.sh installs it into .tools/)")


def kinds(*flags: str) -> dict[str, list[dict]]:
    return by_kind(helm_template(*flags))


def test_the_defaults_render_without_monitors_or_dashboard():
    rendered = kinds()
    assert {"Deployment", "ServiceAccount", "ClusterRole"} <= set(rendered)
    assert not {"PodMonitor", "ServiceMonitor", "ConfigMap"} & set(rendered)


@pytest.mark.parametrize(("flag", "named"), [
    ("imag.repository=ghcr.io/x/y", "additional properties 'imag' not allowed"),
    ("watchNamespace=team-a", "additional properties 'watchNamespace' not allowed"),
    ("watchNamespaces=", "'/watchNamespaces': got string, want array"),
    ("logFormat=yaml", "'/logFormat': value must be one of 'json', 'text', 'full'"),
    ("verbose=yes", "'/verbose': got string, want boolean"),
    ("image.pullPolicy=Sometimes", "'/image/pullPolicy': value must be one of"),
    ("metrics.podMonitor.enabeld=true", "'/metrics/podMonitor': additional properties "
                                        "'enabeld' not allowed"),
    ("metrics.serviceMonitor.interval=15", "'/metrics/serviceMonitor/interval': got number"),
    ("metrics.grafanaDashboard.labels.grafana_dashboard=1",
     "'/metrics/grafanaDashboard/labels/grafana_dashboard': got number, want string"),
    ("policy.controlPlan=true", "'/policy': additional properties 'controlPlan' not allowed"),
    ("webhook.failurePolicy=Never", "'/webhook/failurePolicy': value must be one of 'Ignore', "
                                    "'Fail'"),
    ("webhook.mode=block", "'/webhook/mode': value must be one of 'deny', 'warn'"),
    ("webhook.timeoutSeconds=60", "'/webhook/timeoutSeconds': maximum: got 60, want 30"),
    ("webhook.certificates=vault", "'/webhook/certificates': value must be one of"),
    ("webhook.port=8080", "webhook.port 8080 is the operator's health port"),
    ("webhook.port=443", "'/webhook/port': minimum: got 443"),
    ("gateway.kvEvents.endpoint=tcp://*:5557", "'/gateway/kvEvents/endpoint': "),
    ("gateway.kvEvents.hashAlgo=xxhash", "'/gateway/kvEvents/hashAlgo': value must be one of"),
])
def test_a_bad_value_fails_naming_it(flag, named):
    done = helm_template("--set", flag)
    assert done.returncode != 0
    assert named in done.stderr, done.stderr


def test_both_monitors_at_once_are_refused():
    done = helm_template("--set", "metrics.podMonitor.enabled=true",
                         "--set", "metrics.serviceMonitor.enabled=true")
    assert done.returncode != 0
    assert "metrics.podMonitor.enabled and metrics.serviceMonitor.enabled are both true" \
        in done.stderr, done.stderr


@pytest.mark.parametrize("monitor", ["PodMonitor", "ServiceMonitor"])
def test_either_monitor_alone_renders(monitor):
    key = monitor[0].lower() + monitor[1:]
    rendered = kinds("--set", f"metrics.{key}.enabled=true")
    assert len(rendered[monitor]) == 1
    assert not {"PodMonitor", "ServiceMonitor"} - {monitor} & set(rendered)


def test_the_routers_kv_events_address_reaches_the_operators_policy():
    from kvledger.operator.render.policy import Policy

    [deployment] = kinds("--set", "gateway.kvEvents.endpoint=tcp://epp.gw.svc:5557")["Deployment"]
    env = {var["name"]: var.get("value") for var in
           deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
    gateway = Policy.from_json(env["KVLEDGER_POLICY"]).gateway
    assert (gateway.kv_events, gateway.hash_algo) == ("tcp://epp.gw.svc:5557", "sha256_cbor")
    [default] = kinds()["Deployment"]
    env = {var["name"]: var.get("value") for var in
           default["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert Policy.from_json(env["KVLEDGER_POLICY"]).gateway.kv_events is None


def test_the_dashboard_configmap_carries_the_dashboard():
    rendered = kinds("--set", "metrics.grafanaDashboard.enabled=true",
                     "--set", "metrics.grafanaDashboard.namespace=monitoring",
                     "--set", "metrics.grafanaDashboard.annotations.grafana_folder=LLM")
    [config_map] = rendered["ConfigMap"]
    assert config_map["metadata"]["namespace"] == "monitoring"
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert config_map["metadata"]["annotations"] == {"grafana_folder": "LLM"}
    shipped = json.loads((CHART / "dashboards" / "kvledger.json").read_text())
    assert json.loads(config_map["data"]["kvledger.json"]) == shipped


def operator_args(rendered: dict[str, list[dict]]) -> list[str]:
    [deployment] = rendered["Deployment"]
    return deployment["spec"]["template"]["spec"]["containers"][0]["args"]


def test_the_webhook_renders_by_default_self_signed_with_its_rights():
    rendered = kinds()
    [config] = rendered["ValidatingWebhookConfiguration"]
    [hook] = config["webhooks"]
    assert config["metadata"]["name"] == "kvledger" and "annotations" not in config["metadata"]
    assert hook["name"] == "inferenceservices.kvledger.dev"
    assert hook["clientConfig"] == {"service": {"namespace": "kvledger-system",
                                                "name": "kvledger-webhook",
                                                "path": "/validate", "port": 443}}
    assert hook["rules"] == [{"apiGroups": ["kvledger.dev"], "apiVersions": ["v1alpha1"],
                              "resources": ["inferenceservices"],
                              "operations": ["CREATE", "UPDATE"], "scope": "Namespaced"}]
    assert (hook["failurePolicy"], hook["sideEffects"], hook["timeoutSeconds"],
            hook["admissionReviewVersions"], hook["matchPolicy"]) == (
        "Ignore", "None", 10, ["v1"], "Equivalent")
    assert "namespaceSelector" not in hook
    [service] = [s for s in rendered["Service"] if s["metadata"]["name"] == "kvledger-webhook"]
    assert service["spec"]["ports"] == [{"name": "https", "port": 443, "targetPort": "webhook",
                                         "protocol": "TCP"}]
    [deployment] = rendered["Deployment"]
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert {"name": "webhook", "containerPort": 8443, "protocol": "TCP"} in container["ports"]
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
    assert {"name": "POD_NAMESPACE",
            "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}} in container["env"]
    assert operator_args(rendered)[-7:] == [
        "--webhook-port=8443", "--webhook-timeout=10", "--webhook-mode=deny",
        "--webhook-tls=self-signed", "--webhook-service=kvledger-webhook",
        "--webhook-secret=kvledger-webhook-tls", "--webhook-configuration=kvledger"]
    [cluster_role] = [r for r in rendered["ClusterRole"]
                      if r["metadata"]["name"] == "kvledger-webhook"]
    assert cluster_role["rules"] == [
        {"apiGroups": [""], "resources": ["nodes"], "verbs": ["list", "watch"]},
        # the webhook asks whether a resource's author may read what its spec names
        {"apiGroups": ["authorization.k8s.io"], "resources": ["subjectaccessreviews"],
         "verbs": ["create"]},
        {"apiGroups": ["admissionregistration.k8s.io"],
         "resources": ["validatingwebhookconfigurations"], "resourceNames": ["kvledger"],
         "verbs": ["get", "patch"]}]
    [role] = rendered["Role"]
    assert role["metadata"]["namespace"] == "kvledger-system"
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["secrets"], "resourceNames": ["kvledger-webhook-tls"],
         "verbs": ["get", "update", "patch"]},
        {"apiGroups": [""], "resources": ["secrets"], "verbs": ["create"]}]


def test_a_network_policy_lets_only_the_api_server_reach_the_webhook():
    """The operator's pod admits, by default, its webhook port from any source and nothing
    else; with webhook.networkPolicy.apiServer, that port from those peers alone. It never
    selects an engine pod, even one of a service named as the release."""
    from kvledger.operator.render.render import render_deployment

    rendered = kinds()
    [policy] = rendered["NetworkPolicy"]
    [deployment] = rendered["Deployment"]
    selector = policy["spec"]["podSelector"]["matchLabels"]
    assert selector.items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
    engine = render_deployment("kvledger", "kvledger-system",
                               spec_of({"model": {"path": "/models/m"}, "gpus": 0}))
    assert not selector.items() <= engine["spec"]["template"]["metadata"]["labels"].items()
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    webhook_port = [{"port": "webhook", "protocol": "TCP"}]
    assert policy["spec"]["ingress"] == [{"ports": webhook_port}]
    peers = [{"ipBlock": {"cidr": "10.0.0.0/24"}},
             {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}},
              "podSelector": {"matchLabels": {"k8s-app": "konnectivity-agent"}}}]
    [policy] = kinds("--set-json", f"webhook.networkPolicy.apiServer={json.dumps(peers)}")[
        "NetworkPolicy"]
    assert policy["spec"]["ingress"] == [{"ports": webhook_port, "from": peers}]
    assert "NetworkPolicy" not in kinds("--set", "webhook.networkPolicy.enabled=false")
    assert "NetworkPolicy" not in kinds("--set", "webhook.enabled=false")
    refused = helm_template("--set-json", 'webhook.networkPolicy.apiServer=[{"cidr": "x"}]')
    assert refused.returncode != 0
    assert "'/webhook/networkPolicy/apiServer/0': additional properties 'cidr'" in refused.stderr


def test_the_webhook_with_cert_manager_mounts_its_certificate_and_reads_no_secret():
    rendered = kinds("--api-versions", "cert-manager.io/v1")
    [config] = rendered["ValidatingWebhookConfiguration"]
    assert config["metadata"]["annotations"] == {
        "cert-manager.io/inject-ca-from": "kvledger-system/kvledger-webhook"}
    [certificate], [issuer] = rendered["Certificate"], rendered["Issuer"]
    assert certificate["spec"]["secretName"] == "kvledger-webhook-tls"
    assert certificate["spec"]["dnsNames"] == ["kvledger-webhook.kvledger-system.svc",
                                               "kvledger-webhook.kvledger-system.svc.cluster.local"]
    assert certificate["spec"]["issuerRef"] == {"name": issuer["metadata"]["name"],
                                                "kind": "Issuer", "group": "cert-manager.io"}
    assert issuer["spec"] == {"selfSigned": {}}
    assert operator_args(rendered)[-2:] == ["--webhook-tls=cert-manager",
                                            "--webhook-cert-dir=/etc/kvledger/webhook"]
    assert "Role" not in rendered
    named = kinds("--set", "webhook.certificates=cert-manager",
                  "--set", "webhook.certManager.issuerRef.name=corp-ca",
                  "--set", "webhook.certManager.issuerRef.kind=ClusterIssuer")
    assert "Issuer" not in named
    assert named["Certificate"][0]["spec"]["issuerRef"] == {
        "name": "corp-ca", "kind": "ClusterIssuer", "group": "cert-manager.io"}


def test_an_issuer_of_ones_own_may_be_external_and_needs_a_name():
    external = kinds("--set", "webhook.certificates=cert-manager",
                     "--set", "webhook.certManager.issuerRef.name=pca",
                     "--set", "webhook.certManager.issuerRef.kind=AWSPCAClusterIssuer",
                     "--set", "webhook.certManager.issuerRef.group=awspca.cert-manager.io")
    assert "Issuer" not in external
    assert external["Certificate"][0]["spec"]["issuerRef"] == {
        "name": "pca", "kind": "AWSPCAClusterIssuer", "group": "awspca.cert-manager.io"}
    nameless = helm_template("--set", "webhook.certificates=cert-manager",
                             "--set", "webhook.certManager.issuerRef.kind=ClusterIssuer")
    assert nameless.returncode != 0
    assert "webhook.certManager.issuerRef needs a name" in nameless.stderr, nameless.stderr


def test_self_signed_chosen_by_name_wins_over_a_cluster_with_cert_manager():
    rendered = kinds("--api-versions", "cert-manager.io/v1",
                     "--set", "webhook.certificates=self-signed")
    assert not {"Certificate", "Issuer"} & set(rendered)
    [config] = rendered["ValidatingWebhookConfiguration"]
    assert "annotations" not in config["metadata"]
    assert "caBundle" not in config["webhooks"][0]["clientConfig"]  # the operator writes it
    assert "--webhook-tls=self-signed" in operator_args(rendered)
    [deployment] = rendered["Deployment"]
    assert [v["name"] for v in deployment["spec"]["template"]["spec"]["volumes"]] == ["tmp"]


def test_watched_namespaces_select_the_webhook_and_nodes_stay_cluster_wide():
    rendered = kinds("--set", "watchNamespaces={team-a,team-b}",
                     "--set", "webhook.failurePolicy=Fail", "--set", "webhook.mode=warn")
    [hook] = rendered["ValidatingWebhookConfiguration"][0]["webhooks"]
    assert hook["namespaceSelector"] == {"matchExpressions": [
        {"key": "kubernetes.io/metadata.name", "operator": "In", "values": ["team-a", "team-b"]}]}
    assert hook["failurePolicy"] == "Fail"
    assert "--webhook-mode=warn" in operator_args(rendered)
    # The operator's own (beside those aggregated into edit and view: test_chart_access).
    [cluster_role] = [r for r in rendered["ClusterRole"]
                      if not r["metadata"]["name"].endswith(("-edit", "-view"))]
    assert cluster_role["rules"][0] == {"apiGroups": [""], "resources": ["nodes"],
                                        "verbs": ["list", "watch"]}


def test_without_the_webhook_nothing_of_it_renders():
    rendered = kinds("--set", "webhook.enabled=false")
    assert not {"ValidatingWebhookConfiguration", "Role", "Certificate"} & set(rendered)
    assert [s["metadata"]["name"] for s in rendered.get("Service", [])] == []
    assert not any(a.startswith("--webhook") for a in operator_args(rendered))
    assert all(not {"nodes", "subjectaccessreviews"} & set(r["resources"])
               for c in rendered["ClusterRole"] for r in c["rules"])


def test_the_operator_may_read_the_routers_objectives_and_nothing_more_of_them():
    """The objectives of a service's InferencePool go into its engines' ConfigMap: the
    operator lists and watches them (the handler's event, the resync's list); it never
    writes one."""
    [role] = [r for r in kinds()["ClusterRole"] if r["metadata"]["name"] == "kvledger"]
    granted = [r for r in role["rules"]
               if "inference.networking.x-k8s.io" in r["apiGroups"]]
    assert granted == [{"apiGroups": ["inference.networking.x-k8s.io"],
                        "resources": ["inferenceobjectives"], "verbs": ["list", "watch"]}]
