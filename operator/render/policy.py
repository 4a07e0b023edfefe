"""What only a cluster admin may choose, from the operator's Helm values (``policy`` and
``hub``), never from a resource's spec: whoever may create an InferenceService gets no
more than their namespace already allows them.

- images: ``spec.image`` only from the listed repositories (the operator's engine image's
  always); any other image is code the admin did not approve, run with the pod's rights;
- ``hostPath`` model volumes only under the listed folders (none by default): a host
  folder is the node's, not the namespace's;
- ``priorityClassName`` only from the listed classes (none by default): a class such as
  ``system-cluster-critical`` preempts other tenants' pods;
- control-plane placement (a ``node-role.kubernetes.io/control-plane`` or ``master`` node
  selector, affinity term or toleration, or a toleration of every taint) only when
  allowed (these three judged by ``node_reach``);
- ``spec.model.endpoint`` only from the listed hub endpoints (the public hub by default),
  over https when a token goes with it: the pods send ``HF_TOKEN`` there;
- ``autoscaling.httpAddOn.hosts`` only the service's own cluster names (``NAME.NAMESPACE``,
  ``.svc``, ``.svc.cluster.local``) and the listed patterns (none by default), in which
  ``{name}`` and ``{namespace}`` stand for the resource's: KEDA's interceptor is one for
  the whole cluster, so a host another namespace's clients use (or ``*``) would route
  their requests to this service;
- pod labels and annotations (``spec.podLabels``/``podAnnotations``, and the resource's own
  metadata that reaches the pods) only of the listed keys (none by default): a label can
  make the pods another Service's endpoints, an annotation take them out of the mesh
  (``pod_metadata_policy``);
- with ``networkPolicy.enabled``, each service gets a NetworkPolicy that admits only its
  own namespace's pods and those of the listed namespaces (a gateway's, the metrics
  scraper's) to the engine's port (``network_policy.py`` renders it).

A refusal is a ``PolicyDenied`` (a BadInput) whose one line names the field and the Helm
value to change; the operator shows it as ``Ready=False/PolicyDenied`` and an event. The
engine's own security settings are not pass-through at all: ``spec.env`` takes only the
names of ``env_policy``'s allow-list (a CRD rule, ``spec_rules``), ``envFrom`` none, and
the pod's own are rendered from the spec's fields (``render``).
"""

from __future__ import annotations

import ipaddress
import json
import posixpath
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from kvledger.engine.errors import BadInput, plain
from kvledger.engine.settings.kv_events_config import HASH_ALGOS
from kvledger.operator.api.resource import DEFAULT_HUB_ENDPOINT, DEFAULT_PICKER_PORT
from kvledger.operator.api.spec import ServiceSpec
from kvledger.operator.render.gateway_wiring import NO_GATEWAY, GatewayWiring
from kvledger.operator.render.node_reach import (
    control_plane_field,
    image_allowed,
    listed_images,
    repository,
    under,
)
from kvledger.operator.render.pod_metadata_policy import (
    allowed_resource_metadata,
    refusal,
    refused_key,
)

POLICY_ENV = "KVLEDGER_POLICY"  # the operator's: the chart writes policy and hub values there


class PolicyDenied(BadInput):
    """The spec asks for what only the cluster admin may allow (the Helm value named)."""


@dataclass(frozen=True)
class Policy:
    images: tuple[str, ...] = ()             # repositories (or prefixes ending in '/')
    host_paths: tuple[str, ...] = ()         # hostPath folders allowed, and what is below
    priority_classes: tuple[str, ...] = ()
    control_plane: bool = False
    hub_endpoints: tuple[str, ...] = (DEFAULT_HUB_ENDPOINT,)
    # None: no NetworkPolicy; else the namespaces, besides the service's own, admitted.
    network_policy: tuple[str, ...] | None = None
    # The Endpoint Picker an InferencePool names when its spec names none (Helm value
    # gateway.endpointPicker: a Service each namespace runs, and its port).
    picker: str | None = None
    picker_port: int = DEFAULT_PICKER_PORT
    # What a service behind an InferencePool gets from the Helm values gateway.addresses
    # (the gateway's CIDRs: its fairness header believed) and gateway.kvEvents (the
    # router's address the engines publish KV events to).
    gateway: GatewayWiring = NO_GATEWAY
    # Host patterns autoscaling.httpAddOn.hosts may claim beside the service's own cluster
    # names ({name} and {namespace} the resource's; Helm value policy.httpAddOnHosts).
    http_hosts: tuple[str, ...] = ()
    # Label and annotation keys (or prefixes ending in '/') a resource may put on its pods
    # (Helm values policy.podLabels, policy.podAnnotations): ``pod_metadata_policy``.
    pod_labels: tuple[str, ...] = ()
    pod_annotations: tuple[str, ...] = ()

    @classmethod
    def from_json(cls, text: str | None) -> Policy:
        """The policy in the operator's ``KVLEDGER_POLICY`` (the chart writes its values
        there); the defaults without one. BadInput naming what is wrong."""
        if not text:
            return cls()
        try:
            raw = json.loads(text)
        except ValueError as exc:
            raise BadInput(f"KVLEDGER_POLICY is not JSON: {exc}") from None
        if not isinstance(raw, dict):
            raise BadInput("KVLEDGER_POLICY must be a JSON object")
        unknown = sorted(set(raw) - {"images", "hostPaths", "priorityClasses", "controlPlane",
                                     "hubEndpoints", "networkPolicy", "gateway",
                                     "httpAddOnHosts", "podLabels", "podAnnotations"})
        if unknown:
            raise BadInput(f"KVLEDGER_POLICY: unknown key {unknown[0]!r}")
        endpoints = _strings(raw, "hubEndpoints", (DEFAULT_HUB_ENDPOINT,))
        for endpoint in endpoints:
            if urlsplit(endpoint).scheme not in ("http", "https") or not urlsplit(endpoint).netloc:
                raise BadInput(f"KVLEDGER_POLICY: hubEndpoints: {endpoint!r} is not an "
                               "http(s) URL")
        host_paths = _strings(raw, "hostPaths", ())
        if any(not p.startswith("/") for p in host_paths):
            raise BadInput("KVLEDGER_POLICY: hostPaths must be absolute folders")
        control_plane = raw.get("controlPlane", False)
        if not isinstance(control_plane, bool):
            raise BadInput("KVLEDGER_POLICY: controlPlane must be true or false")
        network = raw.get("networkPolicy") or {}
        if not isinstance(network, dict) or not isinstance(network.get("enabled", False), bool):
            raise BadInput("KVLEDGER_POLICY: networkPolicy must be {enabled: true|false, "
                           "allowNamespaces: [...]}")
        gateway = raw.get("gateway")
        gateway = {} if gateway is None else gateway
        if not isinstance(gateway, dict) or not isinstance(gateway.get("endpointPicker", {}),
                                                           dict):
            raise BadInput("KVLEDGER_POLICY: gateway must be {endpointPicker: {name, port}, "
                           "addresses: [CIDR, ...], kvEvents: {endpoint, hashAlgo}}")
        peers = _strings(gateway, "addresses", ())
        for peer in peers:
            try:
                ipaddress.ip_network(peer, strict=False)
            except ValueError:
                raise BadInput(f"KVLEDGER_POLICY: gateway.addresses: {peer!r} is not an "
                               "address or CIDR") from None
        picker = gateway.get("endpointPicker", {})
        name, port = picker.get("name") or None, picker.get("port", DEFAULT_PICKER_PORT)
        if (name is not None and not isinstance(name, str)) or not isinstance(port, int) \
                or not 0 < port < 65536:
            raise BadInput("KVLEDGER_POLICY: gateway.endpointPicker must be {name: SERVICE, "
                           "port: 1-65535}")
        return cls(images=_strings(raw, "images", ()),
                   host_paths=tuple(posixpath.normpath(p) for p in host_paths),
                   priority_classes=_strings(raw, "priorityClasses", ()),
                   control_plane=control_plane,
                   hub_endpoints=tuple(e.rstrip("/") for e in endpoints),
                   network_policy=_strings(network, "allowNamespaces", ())
                   if network.get("enabled") else None,
                   picker=name, picker_port=port,
                   gateway=GatewayWiring(peers, *_kv_events(gateway.get("kvEvents"))),
                   http_hosts=_strings(raw, "httpAddOnHosts", ()),
                   pod_labels=_strings(raw, "podLabels", ()),
                   pod_annotations=_strings(raw, "podAnnotations", ()))

    def check(self, spec: ServiceSpec, default_image: str, *, name: str | None = None,
              namespace: str | None = None) -> None:
        """PolicyDenied for the first thing ``spec`` asks that this policy does not allow;
        BadInput for an InferencePool whose picker neither the spec nor the admin names.
        The HTTP add-on's hosts are checked when the resource's ``name`` and ``namespace``
        are known (a webhook review of a generated name is not: the operator checks)."""
        if spec.image is not None and not image_allowed(spec.image,
                                                         (*self.images, repository(default_image))):
            raise PolicyDenied(f"spec.image {plain(spec.image)} is not allowed: images are the "
                               "cluster admin's choice (the operator's Helm value "
                               f"policy.images; allowed now: {listed_images(self.images, default_image)})")
        volume = spec.model.volume
        if volume is not None and volume.host_path is not None and not any(
                under(volume.host_path, folder) for folder in self.host_paths):
            raise PolicyDenied(f"spec.model.volume.hostPath {plain(volume.host_path)} is not "
                               "allowed: host folders are the cluster admin's choice (the "
                               "operator's Helm value policy.hostPaths; allowed now: "
                               f"{', '.join(self.host_paths) or 'none'})")
        priority = spec.pod_fields.get("priorityClassName")
        if priority is not None and priority not in self.priority_classes:
            raise PolicyDenied(f"spec.priorityClassName {plain(priority)} is not allowed: "
                               "priority classes are the cluster admin's choice (the operator's "
                               "Helm value policy.priorityClasses; allowed now: "
                               f"{', '.join(self.priority_classes) or 'none'})")
        if not self.control_plane and (where := control_plane_field(spec)):
            raise PolicyDenied(f"{where} places the pods on control-plane nodes: only the "
                               "cluster admin may allow that (the operator's Helm value "
                               "policy.controlPlane)")
        for field, values, allowed in (("podLabels", spec.pod_labels, self.pod_labels),
                                       ("podAnnotations", spec.pod_annotations,
                                        self.pod_annotations)):
            if (key := refused_key(values, allowed)) is not None:
                raise PolicyDenied(refusal(field, key, allowed))
        endpoint = spec.model.endpoint
        if endpoint is not None:
            if endpoint.rstrip("/") not in self.hub_endpoints:
                raise PolicyDenied(f"spec.model.endpoint {plain(endpoint)} is not allowed: the "
                                   "pods send the hub token there, so hub endpoints are the "
                                   "cluster admin's choice (the operator's Helm value "
                                   f"hub.endpoints; allowed now: {', '.join(self.hub_endpoints)})")
            if spec.model.token_secret is not None and urlsplit(endpoint).scheme != "https":
                raise PolicyDenied(f"spec.model.endpoint {plain(endpoint)}: a token "
                                   "(spec.model.tokenSecretRef) is sent over https only")
        add_on = spec.autoscaling.http_add_on if spec.autoscaling is not None else None
        if add_on is not None and name is not None and namespace is not None:
            allowed = self.http_hosts_of(name, namespace)
            for host in add_on.hosts:
                if not any(_host_matches(host, pattern) for pattern in allowed):
                    raise PolicyDenied(
                        f"spec.autoscaling.httpAddOn.hosts {host} is not allowed: KEDA's "
                        "interceptor serves the whole cluster, so hosts are the cluster "
                        "admin's choice (the operator's Helm value policy.httpAddOnHosts, "
                        "{name} and {namespace} standing for the resource's); allowed here: "
                        f"{', '.join(allowed)}")
        if spec.inference_pool is not None and not (spec.inference_pool.picker or self.picker):
            raise BadInput("spec.inferencePool needs its Endpoint Picker: set "
                           "spec.inferencePool.endpointPicker.name (a Service in this "
                           "namespace), or the operator's Helm value gateway.endpointPicker.name")

    def http_hosts_of(self, name: str, namespace: str) -> list[str]:
        """The hosts (and ``*.`` patterns) the resource ``namespace/name`` may claim: its
        Service's cluster names, then the admin's patterns filled in."""
        own = [f"{name}.{namespace}", f"{name}.{namespace}.svc",
               f"{name}.{namespace}.svc.cluster.local"]
        return own + [p.replace("{name}", name).replace("{namespace}", namespace)
                      for p in self.http_hosts]

    def pod_metadata(self, spec: ServiceSpec) -> ServiceSpec:
        """``spec`` with only the resource's own labels and annotations this policy lets
        reach the pods (``pod_metadata_policy``)."""
        return allowed_resource_metadata(spec, self.pod_labels, self.pod_annotations)

    def hub_endpoint(self, spec: ServiceSpec) -> str:
        """The hub endpoint the pods talk to: the spec's (allowed by ``check``), else the
        first the admin listed."""
        return spec.model.endpoint or self.hub_endpoints[0]


def _strings(raw: Mapping[str, Any], key: str, default: tuple[str, ...]) -> tuple[str, ...]:
    value = raw.get(key, list(default))
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise BadInput(f"KVLEDGER_POLICY: {key} must be a list of non-empty strings")
    return tuple(value)


# tcp://HOST:PORT the engines connect to: a wildcard would make them bind instead, open to
# every pod that can reach them (kvledger.engine.settings.kv_events_config's rule, as vLLM's).
_CONNECT = re.compile(r"^tcp://(?![*:\[])[^\s/*]+:(\d{1,5})$")


def _kv_events(raw: Any) -> tuple[str | None, str]:
    """gateway.kvEvents: (the router's address, the key hash) or (None, default)."""
    raw = {} if raw is None else raw
    endpoint, algo = (raw.get("endpoint") or None, raw.get("hashAlgo", "sha256_cbor")) \
        if isinstance(raw, dict) else ("", "")
    match = _CONNECT.match(endpoint) if isinstance(endpoint, str) else None
    if not isinstance(raw, dict) or (endpoint is not None and not (
            match and 0 < int(match[1]) < 65536)) or algo not in HASH_ALGOS:
        raise BadInput("KVLEDGER_POLICY: gateway.kvEvents must be {endpoint: "
                       "tcp://HOST:PORT (the router's, connected to), hashAlgo: "
                       f"{' or '.join(HASH_ALGOS)}}}")
    return endpoint, algo


def _host_matches(host: str, pattern: str) -> bool:
    """Whether a requested host (or ``*.`` pattern) lies within an allowed one: the same,
    or below a ``*.`` pattern (a requested ``*.a.b`` only under an allowed ``*.b`` or the
    same ``*.a.b``); a requested ``*`` only where ``*`` is allowed."""
    if host == pattern or pattern == "*":
        return True
    if pattern.startswith("*."):
        suffix = pattern[1:]  # ".example.com"
        return host.endswith(suffix) and host != suffix.lstrip(".")
    return False
