"""The InferenceService CustomResourceDefinition, and ``kvledger run``'s check against it.

The CRD is built from Python (its spec schema: ``crd_schema.py``, with the rules of
``spec_rules.py``), and both YAML copies, ``crds/inferenceservice.yaml`` and the chart's
``charts/kvledger/crds/inferenceservice.yaml``, are generated from it by one command:

    make crd        # python -m kvledger.operator.api.crd --write

``--check`` names a stale copy (exit 1); no option prints the YAML.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from kvledger.engine.checkpoint.hub.uri import parse_uri
from kvledger.engine.errors import BadInput
from kvledger.operator.api.crd_schema import SPEC_SCHEMA
from kvledger.operator.api.model_sources import check_kserve_shape, refusal
from kvledger.operator.api.names import check_name
from kvledger.operator.api.resource import (
    API_VERSION,
    GROUP,
    KIND,
    PLURAL,
    SHORT_NAMES,
    SINGULAR,
    VERSION,
)
from kvledger.operator.api.spec_rules import BARE_HUB_ID

# The generated copies, from the repository's root.
CRD_FILES = ("crds/inferenceservice.yaml", "charts/kvledger/crds/inferenceservice.yaml")

_CONDITION = {
    "type": "object",
    "required": ["type", "status"],
    "properties": {
        "type": {"type": "string"},
        "status": {"type": "string", "enum": ["True", "False", "Unknown"]},
        "reason": {"type": "string"},
        "message": {"type": "string"},
        "lastTransitionTime": {"type": "string", "format": "date-time"},
        "observedGeneration": {"type": "integer"},
    },
}

_STATUS = {
    "type": "object",
    "properties": {
        "conditions": {
            "type": "array", "items": _CONDITION,
            "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"],
        },
        "plan": {"type": "object", "x-kubernetes-preserve-unknown-fields": True,
                 "description": "the pre-flight plan's numbers (bytes) and human sizes"},
        "model": {
            "type": "object",
            "description": "the hub model's download size, asked once per uri to size the "
                           "emptyDir cache",
            "properties": {"uri": {"type": "string"},
                           "downloadBytes": {"type": "integer", "format": "int64"}},
        },
        "observedGeneration": {"type": "integer"},
        "replicas": {"type": "integer",
                     "description": "pods the Deployment has, or groups the LeaderWorkerSet "
                                    "has (the scale subresource's)"},
        "pods": {"type": "array", "description": "with nodes above 1: every pod of every "
                 "group, its role, phase and readiness", "items": {
                     "type": "object", "properties": {
                         "name": {"type": "string"}, "group": {"type": "integer"},
                         "role": {"type": "string", "enum": ["leader", "worker"]},
                         "phase": {"type": "string"}, "ready": {"type": "boolean"}}}},
        "readyReplicas": {"type": "integer"},
        "updatedReplicas": {"type": "integer",
                            "description": "the Deployment's pods of the current spec's "
                                           "template (a rollout's progress)"},
        "nodeKeySecret": {"type": "string",
                          "description": "with nodes above 1: the Secret holding the group's "
                                         "control-channel key, which the operator created "
                                         "under a name the API server generated"},
        "selector": {"type": "string",
                     "description": "label selector of the pods (the scale subresource's: "
                                    "the HPA reads its Pods metrics with it)"},
        "endpoint": {"type": "string"},
        "url": {"type": "string",
                "description": "the endpoint, where KServe's InferenceService has it"},
        "address": {"type": "object", "description": "KServe's (Knative's Addressable): "
                    "url, the endpoint", "properties": {"url": {"type": "string"}}},
        "startup": {
            "type": "object",
            "description": "the start of the pod that became ready last, measured from its "
                           "status's timestamps: seconds from the pod's start to ready "
                           "(total), of its init containers (preflight, fetch) and of the "
                           "engine container's start to ready (engine)",
            "properties": {
                "readyAt": {"type": "string"},
                "seconds": {"type": "object", "additionalProperties": {"type": "integer"}},
            },
        },
    },
}


SCALE_SUBRESOURCE = {"specReplicasPath": ".spec.replicas",
                     "statusReplicasPath": ".status.replicas",
                     "labelSelectorPath": ".status.selector"}


def _ready(field: str) -> str:
    return '.status.conditions[?(@.type=="Ready")].' + field


PRINTER_COLUMNS = [
    {"name": "Ready", "type": "string", "jsonPath": _ready("status")},
    {"name": "Reason", "type": "string", "jsonPath": _ready("reason")},
    {"name": "Fits", "type": "boolean", "jsonPath": ".status.plan.fits"},
    {"name": "Required", "type": "string", "jsonPath": ".status.plan.required"},
    {"name": "Limit", "type": "string", "jsonPath": ".status.plan.limit"},
    {"name": "Endpoint", "type": "string", "jsonPath": ".status.endpoint"},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]


def crd_manifest() -> dict[str, Any]:
    """The CustomResourceDefinition object (a fresh copy each call)."""
    return copy.deepcopy({
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{PLURAL}.{GROUP}"},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {"kind": KIND, "plural": PLURAL, "singular": SINGULAR,
                      "shortNames": SHORT_NAMES, "categories": ["kvledger"]},
            "versions": [{
                "name": VERSION,
                "served": True,
                "storage": True,
                # kubectl scale and autoscalers write spec.replicas through "scale".
                "subresources": {"status": {}, "scale": SCALE_SUBRESOURCE},
                "additionalPrinterColumns": PRINTER_COLUMNS,
                "schema": {"openAPIV3Schema": {
                    "type": "object",
                    "description": "An LLM served by kvledger, memory planned before start.",
                    "required": ["spec"],
                    "properties": {
                        "apiVersion": {"type": "string"},
                        "kind": {"type": "string"},
                        "metadata": {"type": "object"},
                        "spec": SPEC_SCHEMA,
                        "status": _STATUS,
                    },
                }},
            }],
        },
    })


class _NoAliases(yaml.SafeDumper):
    """Shared sub-schemas written out in full each time, not as YAML anchors (&id001)."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def crd_yaml() -> str:
    header = ("# Generated from operator/api/crd.py, crd_schema.py and spec_rules.py: do not edit;\n"
              "# regenerate both copies with: make crd\n")
    return header + yaml.dump(crd_manifest(), Dumper=_NoAliases, sort_keys=False, width=100)


def stale_files(root: Path) -> list[str]:
    """The generated copies (``CRD_FILES``) under ``root`` that differ from ``crd_yaml()``."""
    text = crd_yaml()
    stale = []
    for name in CRD_FILES:
        path = root / name
        if not path.is_file() or path.read_text(encoding="utf-8") != text:
            stale.append(name)
    return stale


def write_files(root: Path) -> list[str]:
    """Write ``crd_yaml()`` to every copy under ``root``; the ones that changed."""
    changed = stale_files(root)
    for name in changed:
        (root / name).write_text(crd_yaml(), encoding="utf-8")
    return changed


def openapi_schema() -> dict[str, Any]:
    return crd_manifest()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def strict_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` (changed in place) rejecting unknown fields wherever it lists an object's
    fields, as kubectl's default ``--validate=strict`` does."""
    if isinstance(schema.get("properties"), dict) and "additionalProperties" not in schema \
            and not schema.get("x-kubernetes-preserve-unknown-fields"):
        schema["additionalProperties"] = False
    for value in schema.get("properties", {}).values():
        strict_schema(value)
    for key in ("items", "additionalProperties"):
        if isinstance(schema.get(key), dict):
            strict_schema(schema[key])
    return schema


def validate_manifest(doc: Any) -> dict[str, Any]:
    """Check an InferenceService manifest against the CRD schema; return it.

    OpenAPI 3.0 schemas are JSON Schema draft 4 (boolean ``exclusiveMinimum``). A hub uri
    is then parsed by the engine's own parser, which checks what its pattern cannot. The
    CEL rules are checked by ``spec.parse_spec`` (``spec_rules``), with the same wording,
    and the name's (``names``: the webhook's, not the CRD's) here. A uri of another source (``pvc://``,
    ``s3://``, ...) is refused with its rule's words, and a KServe-shaped spec naming
    kvledger's fields (``model_sources``). Raises BadInput naming the first offending field.
    """
    if not isinstance(doc, dict):
        raise BadInput("manifest must be a YAML mapping (an InferenceService)")
    check_kserve_shape(doc.get("spec"))  # KServe's, whatever its apiVersion: say ours
    if doc.get("apiVersion") != API_VERSION or doc.get("kind") != KIND:
        raise BadInput(f"manifest must be apiVersion: {API_VERSION}, kind: {KIND}; "
                       f"got {doc.get('apiVersion')!r}, {doc.get('kind')!r}")
    schema = strict_schema(openapi_schema())
    # The name's own rule (names.py) is the CRD's root CEL, checked below.
    schema["properties"]["metadata"] = {"type": "object", "required": ["name"], "properties": {
        "name": {"type": "string"}}}
    errors = sorted(jsonschema.Draft4Validator(schema).iter_errors(doc),
                    key=lambda e: list(e.absolute_path))
    if errors:
        error = errors[0]
        where = ".".join(str(p) for p in error.absolute_path) or "(top level)"
        if where == "spec.model.uri" and "://" not in str(error.instance):
            raise BadInput(f"invalid InferenceService at {where}: {BARE_HUB_ID}")
        if where == "spec.model.uri" and (said := refusal(error.instance)) is not None:
            raise BadInput(f"invalid InferenceService at {where}: {said}")
        raise BadInput(f"invalid InferenceService at {where}: {_short(error)}")
    try:
        check_name(doc["metadata"]["name"])
    except BadInput as exc:
        raise BadInput(f"invalid InferenceService at metadata.name: {exc}") from None
    uri = doc["spec"]["model"].get("uri")
    if uri is not None:
        try:
            parse_uri(uri)
        except BadInput as exc:
            raise BadInput(f"invalid InferenceService at spec.model.uri: {exc}") from None
    return doc


def _short(error: jsonschema.ValidationError) -> str:
    if error.validator == "additionalProperties":
        return error.message.replace("Additional properties are not allowed", "unknown field(s)")
    if error.validator == "anyOf":
        hint = " (write a decimal as a string, e.g. \"0.8\")" if isinstance(
            error.instance, float) else ""
        return f"{error.instance!r} is neither an integer nor a string{hint}"
    return error.message


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvledger.operator.api.crd",
                                     description="Print the InferenceService CRD's YAML.")
    parser.add_argument("--root", type=Path, default=Path.cwd(), metavar="DIR",
                        help="the repository's root (default: the current directory)")
    action = parser.add_mutually_exclusive_group()
    action.add_argument("--write", action="store_true",
                        help=f"write it to {' and '.join(CRD_FILES)}")
    action.add_argument("--check", action="store_true",
                        help="exit 1 naming each of those files that is stale")
    args = parser.parse_args(argv)
    if args.write:
        changed = write_files(args.root)
        for name in CRD_FILES:
            print(f"{'wrote' if name in changed else 'up to date:'} {name}")
        return 0
    if args.check:
        stale = stale_files(args.root)
        for name in stale:
            print(f"error: {name} is stale; run: make crd", file=sys.stderr)
        return 1 if stale else 0
    sys.stdout.write(crd_yaml())
    return 0


if __name__ == "__main__":
    sys.exit(main())
