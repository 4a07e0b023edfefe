"""The webhook refuses a spec naming a Secret or ConfigMap its author may not read
(``webhook/access_review.py``): the operator's pods would read it on the author's behalf.

Over HTTPS against ``kvledger operator --webhook-port`` (its own process) and kmock's
emulator, which has no authorizer: the test answers the SubjectAccessReviews the operator
sends to ``/apis/authorization.k8s.io/v1/subjectaccessreviews`` as the API server would for
an author who may read only ``READABLE``, and keeps each one asked. Without the check, every
review here was allowed, and no SubjectAccessReview was asked."""

from __future__ import annotations

import kmock
import pytest
from operator_harness import emulated_cluster
from webhook_harness import admission_review, webhook_operator

from kvledger.operator.webhook import access_review

pytestmark = pytest.mark.timeout(180)

NS = "team-a"
AUTHOR = {"username": "alice", "uid": "4a1c3e", "groups": ["ml-engineers", "system:authenticated"],
          "extra": {"scopes.example.com/tenant": ["team-a"]}}
READABLE = {("secrets", "alice-key"), ("configmaps", "alice-settings")}
BROKEN = "broken"  # a name whose review the API server fails (the operator lacks the right)
LOCAL = {"model": {"path": "/m"}, "gpus": 0}
HUB = {"model": {"uri": "hf://org/public", "tokenSecretRef": {"name": "ops-hf-token",
                                                             "key": "token"}}, "gpus": 0}


def with_fields(base: dict, **fields) -> dict:
    return {**base, **fields}


async def test_a_secret_or_config_map_the_author_may_not_read_is_refused_naming_the_field(
        tmp_path):
    asked: list[dict] = []

    def authorizer(request: kmock.Request):
        review = request.data
        asked.append(review)
        attributes = review["spec"]["resourceAttributes"]
        if attributes["name"] == BROKEN:
            return kmock.Response(status=403, payload={
                "kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 403,
                "message": "subjectaccessreviews.authorization.k8s.io is forbidden"})
        allowed = (attributes["resource"], attributes["name"]) in READABLE
        return {**review, "status": {"allowed": allowed}}

    async with emulated_cluster() as cluster:
        cluster.emulator[f"post {access_review.PATH}"] << authorizer
        async with webhook_operator(cluster, tmp_path / "log") as client:
            async def ask(spec, **kw):
                return await client.ask(admission_review(spec, namespace=NS, user=AUTHOR,
                                                         **kw))

            # Another team's API key: refused, naming the field, the Secret and the user.
            refused = await ask(with_fields(LOCAL, apiKeySecretRef={"name": "team-b-key",
                                                                    "key": "k"}))
            assert not refused["allowed"] and refused["status"]["code"] == 403
            message = refused["status"]["message"]
            assert message.startswith("llm: spec.apiKeySecretRef names the Secret team-b-key, "
                                      "which alice may not get in namespace team-a")
            # The review carried who asked, as the API server told the webhook.
            (review,) = asked
            assert review["apiVersion"] == "authorization.k8s.io/v1"
            assert review["spec"]["resourceAttributes"] == {
                "namespace": NS, "verb": "get", "version": "v1", "resource": "secrets",
                "name": "team-b-key"}
            assert (review["spec"]["user"], review["spec"]["uid"], review["spec"]["groups"],
                    review["spec"]["extra"]) == (AUTHOR["username"], AUTHOR["uid"],
                                                 AUTHOR["groups"], AUTHOR["extra"])

            # Their own: allowed.
            own = await ask(with_fields(LOCAL, apiKeySecretRef={"name": "alice-key",
                                                                "key": "k"}))
            assert own["allowed"], (own, asked)

            # The hub token another team keeps, the tenants file, a pull secret, a
            # ConfigMap read into env: each refused by its field.
            for spec, said in (
                    (HUB, "spec.model.tokenSecretRef names the Secret ops-hf-token"),
                    (with_fields(LOCAL, tenantsSecretRef={"name": "t", "key": "y"}),
                     "spec.tenantsSecretRef names the Secret t,"),
                    (with_fields(LOCAL, imagePullSecrets=[{"name": "alice-key"},
                                                          {"name": "registry"}]),
                     "spec.imagePullSecrets[1] names the Secret registry,"),
                    (with_fields(LOCAL, env=[{"name": "OMP_NUM_THREADS", "value": "4"}, {
                        "name": "HF_HUB_ETAG_TIMEOUT", "valueFrom": {"configMapKeyRef": {
                            "name": "team-b-settings", "key": "password"}}}]),
                     "spec.env[1].valueFrom.configMapKeyRef names the ConfigMap "
                     "team-b-settings,")):
                answer = await ask(spec)
                assert not answer["allowed"] and said in answer["status"]["message"], answer
            mine = await ask(with_fields(LOCAL, env=[{
                "name": "NCCL_DEBUG", "valueFrom": {"configMapKeyRef": {
                    "name": "alice-settings", "key": "level"}}}]))
            assert mine["allowed"], mine

            # An update that leaves a reference as it was is not asked again (an admin made
            # it; the author scales the service): allowed without a review.
            before = len(asked)
            scaled = await ask(with_fields(HUB, replicas=2), operation="UPDATE",
                               old_spec=HUB)
            assert scaled["allowed"] and len(asked) == before, scaled
            # One that sends that token for another model is a new use of it: asked, refused.
            private = with_fields(HUB, model={**HUB["model"], "uri": "hf://ops/private"})
            moved = await ask(private, operation="UPDATE", old_spec=HUB)
            assert not moved["allowed"] and len(asked) == before + 1
            assert "spec.model.tokenSecretRef names the Secret ops-hf-token" in (
                moved["status"]["message"])

            # A review the API server fails refuses too (fail closed), saying why.
            broken = await ask(with_fields(LOCAL, apiKeySecretRef={"name": BROKEN,
                                                                   "key": "k"}))
            assert not broken["allowed"] and broken["status"]["code"] == 403
            assert (f"spec.apiKeySecretRef: cannot confirm that alice may get the Secret "
                    f"{BROKEN} (SubjectAccessReview: HTTP 403") in broken["status"]["message"]
