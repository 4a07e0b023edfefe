"""Write operator/api/pod_schemas.json: Kubernetes' own schemas of the pod fields an
InferenceService passes through whole (``affinity``'s three parts, an env var's
``valueFrom``), as structural CRD schemas, so the API server types them to the last field.

They were ``x-kubernetes-preserve-unknown-fields``, which the API server stores however
deep: a resource nesting a thousand levels there would stop every JSON reader in the
operator (kopf's watch included) for every tenant. Typed, an object is as deep as
Kubernetes' own types (about ten levels) and unknown fields are refused or pruned.

From the strict JSON schemas of the ``kubernetes-validate`` package (a test extra), for
the Kubernetes version it knows last; descriptions are dropped (the CRD says what the
fields are: Kubernetes' own). ``tests/operator/api/test_crd.py`` checks the file is what
this script writes.

    .venv/bin/python scripts/vendor_pod_schemas.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

OUT = Path(__file__).parents[1] / "operator" / "api" / "pod_schemas.json"
# The types vendored, by the name crd_pod.py gives them.
ROOTS = {
    "nodeAffinity": "io.k8s.api.core.v1.NodeAffinity",
    "podAffinity": "io.k8s.api.core.v1.PodAffinity",
    "podAntiAffinity": "io.k8s.api.core.v1.PodAntiAffinity",
    "envVarSource": "io.k8s.api.core.v1.EnvVarSource",
}
QUANTITY = "io.k8s.apimachinery.pkg.api.resource.Quantity"
INT_OR_STRING = {"x-kubernetes-int-or-string": True,
                 "anyOf": [{"type": "integer"}, {"type": "string"}]}
# What a structural schema keeps of a JSON schema's keywords (no $ref, no description, no
# additionalProperties false: pruning already drops unknown fields).
KEPT = ("type", "format", "enum", "required", "x-kubernetes-list-type",
        "x-kubernetes-list-map-keys", "x-kubernetes-map-type")


def structural(schema: dict[str, Any], defs: dict[str, Any], seen: tuple[str, ...] = ()) -> dict:
    """``schema`` with its references resolved, as a CRD's structural schema."""
    ref = schema.get("$ref")
    if ref is not None:
        name = ref.rsplit("/", 1)[-1]
        if name == QUANTITY:
            return dict(INT_OR_STRING)
        if name in seen:
            raise SystemExit(f"{name} refers to itself: not a finite schema")
        return structural(defs[name], defs, (*seen, name))
    out: dict[str, Any] = {}
    for key in KEPT:
        if key not in schema:
            continue
        value = schema[key]
        if key == "type" and isinstance(value, list):  # ["string", "null"]: not null here
            (value,) = [v for v in value if v != "null"]
        out[key] = value
    if "properties" in schema:
        out["properties"] = {name: structural(sub, defs, seen)
                             for name, sub in sorted(schema["properties"].items())}
    if "items" in schema:
        out["items"] = structural(schema["items"], defs, seen)
    extra = schema.get("additionalProperties")
    if isinstance(extra, dict):
        out["additionalProperties"] = structural(extra, defs, seen)
    return out


def pod_schemas(version: str | None = None) -> dict[str, Any]:
    """The vendored schemas, from kubernetes-validate's ``version`` (its last by default)."""
    import kubernetes_validate

    version = version or kubernetes_validate.latest_version()
    folder = (Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema"
              / f"v{version}-local-strict")
    defs = json.loads((folder / "_definitions.json").read_text())["$defs"]
    return {"kubernetes": version,
            "types": {name: structural(defs[root], defs) for name, root in ROOTS.items()}}


def text(schemas: dict[str, Any]) -> str:
    return json.dumps(schemas, indent=1, sort_keys=True) + "\n"


def main() -> int:
    OUT.write_text(text(pod_schemas()))
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
