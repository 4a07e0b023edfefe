"""What the README, the chart's README and NOTES.txt and docs/ tell a user to apply works on
a fresh install (issue 52): each ``kubectl apply -f examples/...`` they print passes the
chart's CRD (its schema, and its CEL rules run with cel-python as the API server runs them)
and the admission webhook's spec checks under the chart's default values: ``parse_spec``
and the admin's policy as the chart renders it into the operator (``KVLEDGER_POLICY``;
``policy.hostPaths`` is empty, so a host folder is refused). Every example they name
exists and passes the CRD; one that mounts a host folder says that a cluster needs the
admin's ``policy.hostPaths``. Runs ``helm template`` (scripts/helm_check.sh installs helm
into .tools/; skipped where there is no helm)."""

from __future__ import annotations

import re
from typing import Any

import celpy
import pytest
import yaml
from chart_harness import CHART, HELM, ROOT, by_kind, helm_template

from kvledger.operator.api.crd import validate_manifest
from kvledger.operator.api.spec import parse_spec
from kvledger.operator.render.policy import POLICY_ENV, Policy

DOCS = [ROOT / "README.md", CHART / "README.md", CHART / "templates" / "NOTES.txt",
        *sorted((ROOT / "docs").glob("*.md"))]
APPLY = re.compile(r"kubectl apply -f (examples/[\w.-]+\.yaml)")
NAMED = re.compile(r"examples/[\w.-]+\.yaml")
pytestmark = pytest.mark.skipif(HELM is None, reason="helm is not installed "
                                "(bash scripts/helm_check.sh installs it into .tools/)")


def _found(pattern: re.Pattern) -> dict[str, list[str]]:
    """Example -> the docs that name it so."""
    found: dict[str, list[str]] = {}
    for doc in DOCS:
        for name in pattern.findall(doc.read_text()):
            found.setdefault(name, []).append(doc.relative_to(ROOT).as_posix())
    return found


APPLIED = _found(APPLY)
NAMED_FILES = sorted(set(_found(NAMED)) | {f"examples/{p.name}"
                                           for p in (ROOT / "examples").glob("*.yaml")})


@pytest.fixture(scope="module")
def default_install() -> tuple[Policy, str]:
    """The admin's policy and the engine image as the chart's defaults render them."""
    operator = by_kind(helm_template())["Deployment"][0]["spec"]["template"]["spec"]
    env = {e["name"]: e.get("value") for e in operator["containers"][0]["env"]}
    return Policy.from_json(env[POLICY_ENV]), env["KVLEDGER_ENGINE_IMAGE"]


def _crd_schema() -> dict[str, Any]:
    crd = yaml.safe_load((CHART / "crds" / "inferenceservice.yaml").read_text())
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def _broken_cel_rules(value: Any, schema: dict[str, Any], where: str = "") -> list[str]:
    """Each x-kubernetes-validations rule of the chart's CRD, evaluated as the API server
    does: on every value of the manifest its schema node applies to."""
    env = celpy.Environment()
    broken = []
    for rule in schema.get("x-kubernetes-validations", []):
        program = env.program(env.compile(rule["rule"]))
        if not bool(program.evaluate({"self": celpy.json_to_cel(value)})):
            broken.append(f"{where or '.'}: {rule['message']}")
    if isinstance(value, dict):
        for key, item in value.items():
            child = (schema.get("properties") or {}).get(key)
            if child is None and isinstance(schema.get("additionalProperties"), dict):
                child = schema["additionalProperties"]
            if child is not None:
                broken += _broken_cel_rules(item, child, f"{where}.{key}")
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            broken += _broken_cel_rules(item, schema["items"], f"{where}[{i}]")
    return broken


def _manifest(name: str) -> dict[str, Any]:
    path = ROOT / name
    assert path.is_file(), f"{name} is named in the docs but does not exist"
    return yaml.safe_load(path.read_text())


def test_the_docs_tell_a_new_user_what_to_apply() -> None:
    telling = {doc for docs in APPLIED.values() for doc in docs}
    assert {"charts/kvledger/templates/NOTES.txt", "README.md", "docs/operator.md"} <= telling


@pytest.mark.parametrize("name", sorted(APPLIED))
def test_what_the_docs_apply_passes_a_default_install(name, default_install) -> None:
    policy, engine_image = default_install
    doc = _manifest(name)
    validate_manifest(doc)
    assert _broken_cel_rules(doc, _crd_schema()) == []
    policy.check(parse_spec(doc["spec"]), engine_image)  # PolicyDenied names the Helm value


@pytest.mark.parametrize("name", NAMED_FILES)
def test_every_example_named_passes_the_crd(name) -> None:
    doc = _manifest(name)
    validate_manifest(doc)
    assert _broken_cel_rules(doc, _crd_schema()) == []
    parse_spec(doc["spec"])
    text = (ROOT / name).read_text()
    if "hostPath" in text:  # a cluster's default policy refuses it: the file says so
        assert "policy.hostPaths" in text, name


def test_every_chart_install_line_names_the_image_the_user_built() -> None:
    """Nothing is published under the chart's default image.repository: the users build
    and push it, so each `helm install` the chart's README and the docs print names it."""
    for doc in (ROOT / "README.md", CHART / "README.md", ROOT / "docs" / "operator.md"):
        for command in re.findall(r"^helm install kvledger .*?(?<!\\)\n", doc.read_text(),
                                  re.M | re.S):
            assert "image.repository=" in command, (doc.name, command)
