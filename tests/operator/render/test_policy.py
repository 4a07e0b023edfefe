"""What only the cluster admin may choose (operator/render/policy.py), tried as a resource's author
would: each is refused with one line naming the Helm value to change, and the operator
applies nothing for it (``Ready=False/PolicyDenied``, a Warning event)."""

from __future__ import annotations

import json
import re

import pytest
import pytest_asyncio
from operator_harness import eventually, running_operator, service_manifest
from spec_helpers import spec_of

from kvledger.engine.errors import BadInput
from kvledger.operator.api.resource import API_VERSION, PLURAL
from kvledger.operator.api.spec import parse_spec
from kvledger.operator.cluster.kube import typed
from kvledger.operator.render.policy import Policy, PolicyDenied

IMAGE = "ghcr.io/kvledger/kvledger:0.1.0"
BASE = {"model": {"path": "/models/m", "volume": {"persistentVolumeClaim": {"claimName": "m"},
                                                  "mountPath": "/models"}}}
HOST = {"model": {"path": "/models/m", "volume": {"hostPath": {"path": "/"},
                                                  "mountPath": "/models"}}}
CONTROL_PLANE = "node-role.kubernetes.io/control-plane"


def check(policy: Policy, **fields) -> None:
    policy.check(parse_spec({**BASE, **fields}), IMAGE)


@pytest.mark.parametrize(("fields", "message"), [
    ({"image": "docker.io/evil/miner:latest"},
     "spec.image docker.io/evil/miner:latest is not allowed: images are the cluster admin's "
     "choice (the operator's Helm value policy.images; allowed now: ghcr.io/kvledger/kvledger)"),
    ({"priorityClassName": "system-cluster-critical"},
     "spec.priorityClassName system-cluster-critical is not allowed: priority classes are the "
     "cluster admin's choice (the operator's Helm value policy.priorityClasses; allowed now: "
     "none)"),
    ({"nodeSelector": {CONTROL_PLANE: ""}},
     "spec.nodeSelector places the pods on control-plane nodes: only the cluster admin may "
     "allow that (the operator's Helm value policy.controlPlane)"),
    ({"tolerations": [{"key": CONTROL_PLANE, "operator": "Exists", "effect": "NoSchedule"}]},
     "spec.tolerations places the pods on control-plane nodes"),
    ({"tolerations": [{"operator": "Exists"}]}, "spec.tolerations places the pods on"),
    ({"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": [
            {"key": "node-role.kubernetes.io/master", "operator": "Exists"}]}]}}}},
     "spec.affinity.nodeAffinity places the pods on control-plane nodes"),
], ids=["image", "priority", "node-selector", "toleration", "tolerate-all", "affinity"])
def test_what_only_the_admin_may_choose_is_refused_by_default(fields, message):
    with pytest.raises(PolicyDenied, match="^" + re.escape(message)):
        check(Policy(), **fields)


def test_a_host_folder_is_refused_unless_the_admin_lists_it():
    with pytest.raises(PolicyDenied, match=r"^spec\.model\.volume\.hostPath / is not allowed: "
                                           r"host folders are the cluster admin's choice \(the "
                                           r"operator's Helm value policy\.hostPaths; allowed "
                                           r"now: none\)"):
        Policy().check(parse_spec(HOST), IMAGE)
    models = {"model": {"path": "/models/m", "volume": {"hostPath": {"path": "/srv/models/a"},
                                                        "mountPath": "/models"}}}
    Policy(host_paths=("/srv/models",)).check(parse_spec(models), IMAGE)
    sibling = {"model": {**models["model"], "volume": {"hostPath": {"path": "/srv/models-x"},
                                                       "mountPath": "/models"}}}
    with pytest.raises(PolicyDenied):  # a prefix of the name is not a folder above it
        Policy(host_paths=("/srv/models",)).check(parse_spec(sibling), IMAGE)


def test_what_the_admin_allows_passes():
    policy = Policy(images=("registry.example.com/ml/",), priority_classes=("inference",),
                    control_plane=True)
    check(policy, image="registry.example.com/ml/kvledger:dev", priorityClassName="inference",
          nodeSelector={CONTROL_PLANE: ""}, tolerations=[{"operator": "Exists"}])
    check(Policy(), image="ghcr.io/kvledger/kvledger:0.2.0")  # the engine image, any tag
    check(Policy(), image="ghcr.io/kvledger/kvledger@sha256:" + "a" * 64)
    check(Policy(), affinity={"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": [  # keeping pods off them is fine
            {"key": CONTROL_PLANE, "operator": "DoesNotExist"}]}]}}})
    with pytest.raises(PolicyDenied):  # a repository whose name starts alike is another
        check(Policy(), image="ghcr.io/kvledger/kvledger-evil:1")


def test_the_hub_token_goes_only_to_endpoints_the_admin_allows_over_https():
    gated = {"model": {"uri": "hf://org/m", "tokenSecretRef": {"name": "t", "key": "k"}}}
    with pytest.raises(PolicyDenied, match=r"spec\.model\.endpoint https://attacker\.example is "
                                           r"not allowed: the pods send the hub token there"):
        Policy().check(parse_spec({"model": {**gated["model"],
                                             "endpoint": "https://attacker.example"}}), IMAGE)
    mirror = Policy(hub_endpoints=("https://huggingface.co", "http://mirror.internal"))
    plain = parse_spec({"model": {**gated["model"], "endpoint": "http://mirror.internal/"}})
    with pytest.raises(PolicyDenied, match=r"a token .* is sent over https only"):
        mirror.check(plain, IMAGE)
    mirror.check(parse_spec({"model": {"uri": "hf://org/m", "endpoint": "http://mirror.internal"}}),
                 IMAGE)  # no token: the admin's plain-http mirror is fine
    assert mirror.hub_endpoint(parse_spec(gated)) == "https://huggingface.co"


def test_the_policy_comes_from_the_charts_json():
    policy = Policy.from_json(json.dumps({"images": ["r.example/x"], "hostPaths": ["/srv/m/"],
                                          "priorityClasses": ["p"], "controlPlane": True,
                                          "hubEndpoints": ["https://hf.example/"]}))
    assert policy == Policy(images=("r.example/x",), host_paths=("/srv/m",),
                            priority_classes=("p",), control_plane=True,
                            hub_endpoints=("https://hf.example",))
    assert Policy.from_json(None) == Policy() == Policy.from_json("")
    for bad, message in (("{", "not JSON"), ("[]", "must be a JSON object"),
                         ('{"imagez": []}', "unknown key 'imagez'"),
                         ('{"hostPaths": ["srv"]}', "absolute folders"),
                         ('{"hubEndpoints": ["ftp://x"]}', "not an http"),
                         ('{"controlPlane": "yes"}', "true or false"),
                         ('{"images": "x"}', "list of non-empty strings")):
        with pytest.raises(BadInput, match=message):
            Policy.from_json(bad)


# -- in the operator ---------------------------------------------------------------------

NS = "default"
pytestmark = pytest.mark.filterwarnings("ignore:read_binary is deprecated:DeprecationWarning")


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def cluster():
    async with running_operator(default_image=IMAGE) as running:
        yield running


@pytest.mark.asyncio(loop_scope="module")
@pytest.mark.timeout(60)
async def test_the_operator_applies_nothing_the_policy_refuses_and_says_why(cluster):
    await cluster.create(API_VERSION, PLURAL, service_manifest(
        "rooted", NS, model=HOST["model"], priorityClassName="system-cluster-critical"))

    def refused():
        obj = cluster.stored(API_VERSION, PLURAL, NS, "rooted") or {}
        for c in (obj.get("status") or {}).get("conditions") or []:
            if c["type"] == "Ready" and c["reason"] == "PolicyDenied":
                return c
        return None

    ready = await eventually(refused, what="Ready=False/PolicyDenied", timeout_s=30)
    assert ready["status"] == "False"
    assert ready["message"].startswith("spec.model.volume.hostPath / is not allowed")
    assert cluster.stored("apps/v1", "deployments", NS, "rooted") is None
    events = await eventually(lambda: [e for e in cluster.events_for("rooted")
                                       if e.get("reason") == "PolicyDenied"],
                              what="a PolicyDenied event", timeout_s=30)
    assert events[0]["type"] == "Warning"


@pytest.mark.asyncio(loop_scope="module")
@pytest.mark.timeout(60)
@pytest.mark.parametrize(("name", "fields", "named"), [
    ("preload", {"env": [{"name": "NCCL_DEBUG", "value": "INFO"},
                         {"name": "LD_PRELOAD", "value": "/models/m/evil.so"}]},
     "env LD_PRELOAD: not a variable a resource may set"),
    ("proxied", {"model": {"uri": "hf://org/m", "tokenSecretRef": {"name": "t", "key": "k"}},
                 "env": [{"name": "https_proxy", "value": "http://attacker.example:3128"}]},
     "env https_proxy: not a variable a resource may set"),
    ("imported", {"envFrom": [{"secretRef": {"name": "loader"}}]},
     "envFrom secretRef loader: envFrom is refused"),
])
async def test_a_stored_resource_with_env_the_rules_now_refuse_is_refused_by_name(
        cluster, name, fields, named):
    """A resource stored before the allow-list (the emulator, like an API server with CRD
    validation ratcheting, stores it unchecked) gets Ready=False/InvalidSpec naming the
    variable or the envFrom source, a Warning event, and nothing applied."""
    await cluster.create(API_VERSION, PLURAL, service_manifest(name, NS, **fields))

    def refused():
        obj = cluster.stored(API_VERSION, PLURAL, NS, name) or {}
        return next((c for c in (obj.get("status") or {}).get("conditions") or []
                     if c["type"] == "Ready" and c["reason"] == "InvalidSpec"), None)

    ready = await eventually(refused, what="Ready=False/InvalidSpec", timeout_s=30)
    assert ready["message"].startswith(named)
    assert cluster.stored("apps/v1", "deployments", NS, name) is None
    events = await eventually(lambda: [e for e in cluster.events_for(name)
                                       if e.get("reason") == "InvalidSpec"],
                              what="an InvalidSpec event", timeout_s=30)
    assert events[0]["type"] == "Warning" and events[0]["message"].startswith(named)


def test_the_network_policy_admits_the_namespace_and_the_listed_ones_on_the_port():
    import kubernetes_validate

    from kvledger.operator.render.network_policy import render_network_policy
    from kvledger.operator.render.render import LABEL

    policy = render_network_policy("llama", "team-a", spec_of({**BASE, "port": 9000}), ("monitoring",))
    kubernetes_validate.validate(policy, kubernetes_validate.latest_version(), strict=True)
    typed(policy)  # and sent as the client's typed model, unchanged
    assert policy["spec"]["podSelector"] == {"matchLabels": {LABEL: "llama"}}
    assert policy["spec"]["ingress"] == [{
        "from": [{"podSelector": {}},
                 {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name":
                                                        "monitoring"}}}],
        "ports": [{"protocol": "TCP", "port": 9000}]}]


@pytest.mark.asyncio(loop_scope="module")
@pytest.mark.timeout(60)
async def test_with_network_policies_on_each_service_gets_one_and_it_goes_with_it():
    policy = Policy(network_policy=("monitoring",))
    async with running_operator(default_image=IMAGE, policy=policy) as cluster:
        await cluster.create(API_VERSION, PLURAL, service_manifest("fenced", NS, model=BASE["model"]))
        fence = await eventually(lambda: cluster.stored("networking.k8s.io/v1", "networkpolicies",
                                                        NS, "fenced"), what="NetworkPolicy")
        assert fence["metadata"]["ownerReferences"][0]["name"] == "fenced"
        await cluster.delete(API_VERSION, PLURAL, NS, "fenced")
        await eventually(lambda: cluster.stored("networking.k8s.io/v1", "networkpolicies",
                                                NS, "fenced") is None, what="NetworkPolicy gone")


# Pod Security Admission's "restricted" profile (Kubernetes' pod security standards), the
# checks that concern what the operator renders.
RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral",
                      "persistentVolumeClaim", "projected", "secret"}


def restricted_violations(pod: dict) -> list[str]:
    found = []
    pod_context = pod.get("securityContext") or {}
    for field in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(field):
            found.append(field)
    for volume in pod.get("volumes", []):
        kinds = set(volume) - {"name"}
        if not kinds <= RESTRICTED_VOLUMES:
            found.append(f"volume {volume['name']}: {sorted(kinds)}")
    for container in (*pod.get("initContainers", []), *pod["containers"]):
        context = container.get("securityContext") or {}
        name = container["name"]
        if context.get("privileged"):
            found.append(f"{name}: privileged")
        if context.get("allowPrivilegeEscalation") is not False:
            found.append(f"{name}: allowPrivilegeEscalation not false")
        capabilities = context.get("capabilities") or {}
        if "ALL" not in capabilities.get("drop", []):
            found.append(f"{name}: capabilities not dropped")
        if set(capabilities.get("add", [])) - {"NET_BIND_SERVICE"}:
            found.append(f"{name}: capabilities added")
        if not (context.get("runAsNonRoot", pod_context.get("runAsNonRoot"))):
            found.append(f"{name}: runAsNonRoot")
        if context.get("runAsUser", pod_context.get("runAsUser")) == 0:
            found.append(f"{name}: runAsUser 0")
        seccomp = (context.get("seccompProfile") or pod_context.get("seccompProfile") or {})
        if seccomp.get("type") not in ("RuntimeDefault", "Localhost"):
            found.append(f"{name}: seccompProfile")
        if any("hostPort" in port for port in container.get("ports", [])):
            found.append(f"{name}: hostPort")
    return found


@pytest.mark.parametrize("spec", [
    BASE,
    {"model": {"uri": "hf://org/m", "tokenSecretRef": {"name": "t", "key": "k"}}, "gpus": 2},
    {**BASE, "apiKeySecretRef": {"name": "k", "key": "api"}, "allowRuntimeLoraUpdating": True,
     "env": [{"name": "NCCL_DEBUG", "value": "INFO"}]},
], ids=["claim", "hub-tensor-parallel", "api-key"])
def test_rendered_pods_meet_pod_security_restricted(spec):
    from kvledger.operator.render.render import render_deployment

    pod = render_deployment("m", "team-a", spec_of(spec), download_bytes=2**30)["spec"]["template"]["spec"]
    assert restricted_violations(pod) == []
    # The one exception, and only when the admin allows it: a host folder.
    host = render_deployment("m", "team-a", spec_of(HOST))["spec"]["template"]["spec"]
    assert restricted_violations(host) == ["volume model: ['hostPath']"]
