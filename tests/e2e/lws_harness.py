"""A LeaderWorkerSet's pods as the LWS controller makes them, and what podman 4.3 lacks to
play them (``tests/e2e/test_leader_worker_set.py``).

The controller (kubernetes-sigs/lws, read from its source: ``pkg/utils/pod/pod_utils.go``
``AddLWSVariables`` and the pod naming of its leader and worker StatefulSets) names group
G's leader ``<lws>-G`` and its workers ``<lws>-G-<i>``; labels them with the set's name,
the group index and the worker index; annotates the group size; and puts
``LWS_LEADER_ADDRESS`` (``<lws>-G.<subdomain>.<namespace>``), ``LWS_GROUP_SIZE`` and
``LWS_WORKER_INDEX`` first in the env of every container and init container.
"""

from __future__ import annotations

import copy
import re
from typing import Any

NAME_LABEL = "leaderworkerset.sigs.k8s.io/name"
GROUP_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/group-index"
WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"
SIZE_ANNOTATION = "leaderworkerset.sigs.k8s.io/size"


def group_pods(lws: dict[str, Any], group: int = 0) -> list[dict[str, Any]]:
    """Group ``group``'s pods, leader first, as the controller creates them."""
    name, namespace = lws["metadata"]["name"], lws["metadata"]["namespace"]
    template = lws["spec"]["leaderWorkerTemplate"]
    size = template["size"]
    policy = lws["spec"].get("networkConfig", {}).get("subdomainPolicy", "Shared")
    subdomain = f"{name}-{group}" if policy == "UniquePerReplica" else name
    leader_name = f"{name}-{group}"
    pods = []
    for index in range(size):
        source = template["leaderTemplate"] if index == 0 else template["workerTemplate"]
        pod_name = leader_name if index == 0 else f"{leader_name}-{index}"
        meta = copy.deepcopy(source.get("metadata", {}))
        meta["name"], meta["namespace"] = pod_name, namespace
        meta.setdefault("labels", {}).update({NAME_LABEL: name, GROUP_INDEX_LABEL: str(group),
                                              WORKER_INDEX_LABEL: str(index)})
        meta.setdefault("annotations", {})[SIZE_ANNOTATION] = str(size)
        spec = copy.deepcopy(source["spec"])
        spec["hostname"], spec["subdomain"] = pod_name, subdomain
        injected = [{"name": "LWS_LEADER_ADDRESS",
                     "value": f"{leader_name}.{subdomain}.{namespace}"},
                    {"name": "LWS_GROUP_SIZE", "value": str(size)},
                    {"name": "LWS_WORKER_INDEX", "value": str(index)}]
        for container in spec.get("initContainers", []) + spec["containers"]:
            taken = {e["name"] for e in injected}
            container["env"] = injected + [e for e in container.get("env", [])
                                           if e["name"] not in taken]
        pods.append({"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec})
    return pods


def expand(text: str, env: dict[str, str]) -> str:
    """The kubelet's ``$(VAR)`` expansion of a container's command and args: a variable
    the env defines is replaced, ``$$`` is a literal ``$``, anything else is left as is."""
    def one(match: re.Match) -> str:
        if match.group(0) == "$$":
            return "$"
        return env.get(match.group(1), match.group(0))

    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)", one, text)


def for_podman(pod: dict[str, Any], *, leader_address: str,
               secrets: dict[str, dict[str, str]], http_port: int) -> dict[str, Any]:
    """What podman 4.3's ``kube play`` lacks, and only that:

    - no cluster DNS: ``LWS_LEADER_ADDRESS`` is ``leader_address``: in the leader, its own
      hostname (its /etc/hosts maps it to its IP, as the cluster's DNS maps LWS's leader
      address to the leader pod's IP: machine 0 listens there, not on every interface); in
      a worker, the leader pod's IP;
    - no ``$(VAR)`` expansion in args (the kubelet's): expanded here;
    - no Secrets: a ``secretKeyRef`` becomes its value (``secrets``: name -> key -> value);
    - every ``containerPort`` is published on the host: only the HTTP port is kept;
    - ``restartPolicy: Never`` and emptyDir names per pod, as ``test_container.for_podman``.
    """
    out = copy.deepcopy(pod)
    spec = out["spec"]
    spec["restartPolicy"] = "Never"
    prefix = out["metadata"]["name"] + "-"
    renamed = {v["name"]: prefix + v["name"] for v in spec.get("volumes", []) if "emptyDir" in v}
    for volume in spec.get("volumes", []):
        volume["name"] = renamed.get(volume["name"], volume["name"])
    for container in spec.get("initContainers", []) + spec["containers"]:
        for mount in container.get("volumeMounts", []):
            mount["name"] = renamed.get(mount["name"], mount["name"])
        env = []
        for var in container.get("env", []):
            if var["name"] == "LWS_LEADER_ADDRESS":
                var = {"name": var["name"], "value": leader_address}
            elif "secretKeyRef" in var.get("valueFrom", {}):
                ref = var["valueFrom"]["secretKeyRef"]
                var = {"name": var["name"], "value": secrets[ref["name"]][ref["key"]]}
            env.append(var)
        container["env"] = env
        values = {var["name"]: var["value"] for var in env if "value" in var}
        for key in ("command", "args"):
            if key in container:
                container[key] = [expand(arg, values) for arg in container[key]]
        if "ports" in container:
            container["ports"] = [p for p in container["ports"]
                                  if p["containerPort"] == http_port]
    return out
