"""Who may use the operator's resources and how its pod is pulled: the ClusterRoles
aggregated into the built-in edit and view roles (on by default), the operator pod's
imagePullSecrets and podAnnotations, watchNamespaces refused where a glob would render an
uninstallable Role, and NOTES naming the resource unambiguously beside KServe's."""

from __future__ import annotations

import pytest
from chart_harness import CHART, HELM, by_kind, helm_template

pytestmark = pytest.mark.skipif(HELM is None, reason="helm is not installed "
                                "(bash scripts/helm_check.sh installs it into .tools/)")

AGGREGATE = "rbac.authorization.k8s.io/aggregate-to-"


def _aggregated(*flags: str) -> dict[str, dict]:
    roles = by_kind(helm_template(*flags)).get("ClusterRole", [])
    return {role["metadata"]["name"]: role for role in roles
            if any(key.startswith(AGGREGATE) for key in role["metadata"]["labels"])}


@pytest.mark.parametrize("flags", [(), ("--set", "watchNamespaces={team-a}")])
def test_edit_and_view_users_get_inferenceservices_by_default(flags):
    roles = _aggregated(*flags)
    edit, view = roles["kvledger-edit"], roles["kvledger-view"]
    assert edit["metadata"]["labels"][AGGREGATE + "edit"] == "true"
    assert edit["metadata"]["labels"][AGGREGATE + "admin"] == "true"
    assert view["metadata"]["labels"][AGGREGATE + "view"] == "true"
    [own] = [rule for rule in edit["rules"] if rule["resources"] == ["inferenceservices"]]
    assert own["apiGroups"] == ["kvledger.dev"] and {"create", "patch", "delete"} <= set(
        own["verbs"])
    assert all(rule["apiGroups"] == ["kvledger.dev"] for role in roles.values()
               for rule in role["rules"])  # nothing of anyone else's
    assert all(set(rule["verbs"]) <= {"get", "list", "watch"} for rule in view["rules"])


def test_the_aggregated_roles_can_be_turned_off():
    assert _aggregated("--set", "rbac.aggregateToDefaultRoles=false") == {}


def test_the_operator_pod_takes_pull_secrets_and_annotations():
    [deployment] = by_kind(helm_template(
        "--set-json", 'imagePullSecrets=[{"name": "regcred"}]',
        "--set", "podAnnotations.example\\.com/team=ml"))["Deployment"]
    pod = deployment["spec"]["template"]
    assert pod["spec"]["imagePullSecrets"] == [{"name": "regcred"}]
    assert pod["metadata"]["annotations"] == {"example.com/team": "ml"}
    [plain] = by_kind(helm_template())["Deployment"]
    assert "imagePullSecrets" not in plain["spec"]["template"]["spec"]
    assert "annotations" not in plain["spec"]["template"]["metadata"]


@pytest.mark.parametrize(("flag", "named"), [
    ("watchNamespaces={team-*}", "'/watchNamespaces/0': 'team-*' does not match pattern"),
    ("watchNamespaces={Team_A}", "'/watchNamespaces/0': 'Team_A' does not match pattern"),
    ("imagePullSecrets[0].nam=x", "'/imagePullSecrets/0': additional properties 'nam'"),
    ("podAnnotations.a=1", "'/podAnnotations/a': got number, want string"),
    ("rbac.aggregate=true", "'/rbac': additional properties 'aggregate' not allowed"),
])
def test_a_value_the_chart_cannot_render_is_refused_naming_it(flag, named):
    done = helm_template("--set", flag)
    assert done.returncode != 0 and named in done.stderr, done.stderr


def test_notes_name_the_resource_apart_from_kserves_and_how_to_upgrade_the_crd():
    notes = (CHART / "templates" / "NOTES.txt").read_text()
    assert "kubectl get kvis" in notes and "inferenceservices.kvledger.dev" in notes
    assert "kubectl get inferenceservices " not in notes
    assert "kubectl apply --server-side -f charts/kvledger/crds/" in notes
