"""What the webhook asks the API server about (``webhook/access_review.py``), with an API
that answers as an authorizer would: which references an UPDATE changes, one review per
Secret, and a check that cannot finish refusing rather than letting the spec in."""

from __future__ import annotations

import asyncio

from kvledger.operator.webhook.access_review import MAX_REVIEWS, refusals, to_confirm

USER = {"username": "alice", "groups": ["devs"]}
TOKEN = {"uri": "hf://org/a", "tokenSecretRef": {"name": "hf", "key": "token"}}


class Authorizer:
    """Allows ``get`` on the names in ``readable``; keeps every review; ``delay_s`` each."""

    def __init__(self, readable=(), delay_s: float = 0.0) -> None:
        self.readable, self.delay_s, self.asked = set(readable), delay_s, []

    async def create(self, path, body):
        self.asked.append(body["spec"]["resourceAttributes"]["name"])
        await asyncio.sleep(self.delay_s)
        return {**body, "status": {"allowed": self.asked[-1] in self.readable}}


def fields(spec, old=None) -> list[str]:
    return [ref.field for ref in to_confirm(spec, old)]


def test_an_update_asks_about_what_it_adds_or_changes_only():
    spec = {"model": TOKEN, "apiKeySecretRef": {"name": "k", "key": "a"},
            "env": [{"name": "NCCL_DEBUG", "valueFrom": {"configMapKeyRef": {
                "name": "c", "key": "level"}}}, {"name": "OMP_NUM_THREADS", "value": "4"}]}
    assert fields(spec) == ["spec.apiKeySecretRef", "spec.env[0].valueFrom.configMapKeyRef",
                            "spec.model.tokenSecretRef"]
    assert fields({**spec, "replicas": 3}, spec) == []
    assert fields({**spec, "env": spec["env"][::-1]}, spec) == []  # reordered: the same uses
    assert fields({**spec, "apiKeySecretRef": {"name": "k", "key": "b"}}, spec) == [
        "spec.apiKeySecretRef"]  # another key of the same Secret
    for model in ({**TOKEN, "uri": "hf://org/b"}, {**TOKEN, "endpoint": "https://m.example"}):
        assert fields({**spec, "model": model}, spec) == ["spec.model.tokenSecretRef"]
    moved = {**spec, "tenantsSecretRef": {"name": "k", "key": "a"}}
    del moved["apiKeySecretRef"]
    assert fields(moved, spec) == ["spec.tenantsSecretRef"]  # the key, now a tenants file
    assert fields(spec, {"model": "not a mapping", "env": [None, 3]}) == fields(spec)


def test_one_review_per_secret_whatever_fields_name_it():
    api = Authorizer()
    spec = {"apiKeySecretRef": {"name": "s", "key": "a"},
            "tenantsSecretRef": {"name": "s", "key": "b"}}
    lines = asyncio.run(refusals(api, USER, "ns", to_confirm(spec, None), 5.0))
    assert api.asked == ["s"] and len(lines) == 2  # each field named in the refusal
    assert asyncio.run(refusals(Authorizer({"s"}), USER, "ns", to_confirm(spec, None),
                                5.0)) == []


def test_what_cannot_be_confirmed_is_refused():
    spec = {"apiKeySecretRef": {"name": "s", "key": "a"}}
    slow = asyncio.run(refusals(Authorizer({"s"}, delay_s=1.0), USER, "ns",
                                to_confirm(spec, None), 0.05))
    assert slow == ["spec.apiKeySecretRef: cannot confirm that alice may get the Secret s "
                    "(SubjectAccessReview: no answer within the webhook's deadline)"]
    for nobody in (None, {"username": ""}):
        assert asyncio.run(refusals(Authorizer({"s"}), nobody, "ns", to_confirm(spec, None),
                                    5.0)) == ["spec.apiKeySecretRef: the request names no "
                                              "user to ask about"]
    many = {"imagePullSecrets": [{"name": f"pull-{i}"} for i in range(MAX_REVIEWS + 1)]}
    api = Authorizer({f"pull-{i}" for i in range(MAX_REVIEWS + 1)})
    (line,) = asyncio.run(refusals(api, USER, "ns", to_confirm(many, None), 5.0))
    assert f"names {MAX_REVIEWS + 1} Secrets, ConfigMaps and claims" in line and api.asked == []


def test_a_hub_adapter_added_beside_a_token_is_a_new_use_of_it():
    # fetch downloads spec.adapters' hub uris with model.tokenSecretRef's token: an author
    # who may edit the resource but not read that token adds another team's private
    # adapter, and fetch sent the token for it (the update was not asked about).
    spec = {"model": TOKEN, "adapters": [{"name": "a", "uri": "hf://org/public-lora"}]}
    private = {**spec, "adapters": [*spec["adapters"],
                                    {"name": "b", "uri": "hf://team-b/private-lora"}]}
    assert fields(private, spec) == ["spec.model.tokenSecretRef"]
    local = {**spec, "adapters": [*spec["adapters"], {"name": "c", "uri": "/m/lora"}]}
    assert fields(local, spec) == []  # a directory on the volume is read without the token
    assert fields({**spec, "adapters": spec["adapters"][::-1]}, spec) == []


def test_a_claim_the_author_may_not_read_is_asked_about():
    # model.volume's claim is mounted (its checkpoint served to the author) and
    # model.cache's written by fetch: another team's claim was either, unasked.
    spec = {"model": {"path": "/m/ckpt", "volume": {"persistentVolumeClaim": {
        "claimName": "team-b-weights"}, "mountPath": "/m"}},
        "gpus": 0}
    hub = {"model": {"uri": "hf://org/a", "cache": {"persistentVolumeClaim": {
        "claimName": "team-b-cache"}}}}
    assert fields(spec) == ["spec.model.volume.persistentVolumeClaim"]
    assert fields(hub) == ["spec.model.cache.persistentVolumeClaim"]
    api = Authorizer({"team-b-cache"})
    (line,) = asyncio.run(refusals(api, USER, "ns", to_confirm(spec, None), 5.0))
    assert line.startswith("spec.model.volume.persistentVolumeClaim names the "
                           "PersistentVolumeClaim team-b-weights, which alice may not get")
    assert asyncio.run(refusals(api, USER, "ns", to_confirm(hub, None), 5.0)) == []
