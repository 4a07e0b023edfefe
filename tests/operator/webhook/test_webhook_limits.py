"""The webhook's server under clients that are not the API server, through the door they
use: ``kvledger operator --webhook-port`` in its own process (tests/webhook_harness.py),
spoken to over TLS as a hostile pod in the cluster would (tests/hostile_clients.py).

Connections past the cap are closed before TLS; those that handshake and say nothing, or
never handshake, are closed within the timeouts; a body over the cap is refused from its
Content-Length, one that trickles is timed out; what is not an AdmissionReview gets a 400
of one line and no Python; every answer is ``admission.k8s.io/v1``'s with the request's
uid; UPDATEs of made-up uids leave nothing behind."""

from __future__ import annotations

import asyncio
import json

import pytest
from hostile_clients import (
    close_all,
    exchange,
    open_tcp,
    open_tls,
    post_head,
    rss_mib,
    still_open,
)
from operator_harness import emulated_cluster
from webhook_harness import admission_review, webhook_operator

from kvledger.operator.webhook import admission_review as contract
from kvledger.operator.webhook.webhook_server import (
    BODY_TIMEOUT_S,
    HANDSHAKE_TIMEOUT_S,
    HEADER_TIMEOUT_S,
    MAX_BODY_BYTES,
    MAX_CONNECTIONS,
)

LOCAL = {"model": {"path": "/m"}, "gpus": 1}


async def test_connections_past_the_cap_are_refused_and_silent_ones_closed(tmp_path):
    async with emulated_cluster() as cluster, webhook_operator(cluster, tmp_path / "log") as client:
        base = rss_mib(client.pid)
        opened = await asyncio.gather(*(open_tls(client.port, client.trust)
                                        for _ in range(MAX_CONNECTIONS + 40)))
        tls = [s for s in opened if s is not None]
        grown = rss_mib(client.pid) - base
        tcp = [s for s in await asyncio.gather(*(open_tcp(client.port) for _ in range(5))) if s]
        # The harness's client holds one connection of its own: the rest of the cap is ours.
        assert MAX_CONNECTIONS - 2 <= len(tls) <= MAX_CONNECTIONS - 1
        assert grown < MAX_CONNECTIONS * 0.5, grown  # ~0.3 MiB a TLS connection, held
        await asyncio.sleep(max(HEADER_TIMEOUT_S, HANDSHAKE_TIMEOUT_S) + 2.0)
        assert await still_open(tls) == 0 and await still_open(tcp) == 0
        close_all(tls + tcp)
        assert (await client.ask(admission_review(LOCAL)))["allowed"]


async def test_a_body_over_the_cap_or_that_trickles_is_refused(tmp_path):
    async with emulated_cluster() as cluster, webhook_operator(cluster, tmp_path / "log") as client:
        # Refused from its Content-Length: not a byte of the body is sent.
        status, text = await exchange(client.port, client.trust, post_head(1_000_000), 3.0)
        assert (status, text) == (413, f"an AdmissionReview is at most "
                                       f"{MAX_BODY_BYTES // 1024} KiB\n")
        status, _ = await exchange(client.port, client.trust, post_head(None) + b"5\r\n{}", 3.0)
        assert status == 411
        started = asyncio.get_running_loop().time()
        status, text = await exchange(client.port, client.trust,
                                      post_head(20_000) + b'{"request": ', BODY_TIMEOUT_S + 5)
        took = asyncio.get_running_loop().time() - started
        assert status == 408 and "did not arrive within" in text
        assert BODY_TIMEOUT_S - 0.5 < took < BODY_TIMEOUT_S + 3


def not_reviews() -> dict[str, bytes]:
    good = admission_review(LOCAL)
    request = good["request"]

    def with_object(**changes) -> dict:
        return dict(good, request=dict(request, object=dict(request["object"], **changes)))

    bodies = {"a list": [good], "null": None, "{}": {}, "a string": "review",
              "request a string": dict(good, request="r"),
              "request a list": dict(good, request=[request]),
              "uid an object": dict(good, request=dict(request, uid={"a": 1})),
              "object a string": dict(good, request=dict(request, object="llm")),
              "metadata a string": with_object(metadata="llm"),
              "name an object": with_object(metadata={"name": {"a": 1}}),
              "spec a list": with_object(spec=[{"gpus": 1}])}
    encoded = {what: json.dumps(body).encode() for what, body in bodies.items()}
    return encoded | {"not JSON": b'{"apiVersion": ', "nested 100,000 deep": b"[" * 100_000}


PYTHON = ("Traceback", "Error", "object has no attribute", "NoneType", "'list'", "'str'",
          "'dict'", "sequence element", "indices")


async def test_what_is_not_an_admission_review_is_a_400_of_one_line(tmp_path):
    async with emulated_cluster() as cluster, webhook_operator(cluster, tmp_path / "log") as client:
        for what, body in not_reviews().items():
            status, text = await exchange(client.port, client.trust,
                                          post_head(len(body)) + body)
            assert status == 400, (what, status, text)
            assert text.startswith("not an AdmissionReview: ") and text.count("\n") == 1, what
            assert not any(word in text for word in PYTHON), (what, text)
        # Still answering, as the contract says, whatever the request called itself.
        bogus = admission_review(LOCAL) | {"apiVersion": "evil.example/v9", "kind": "Nonsense"}
        body = json.dumps(bogus).encode()
        status, text = await exchange(client.port, client.trust, post_head(len(body)) + body)
        answer = json.loads(text)
        assert status == 200 and (answer["apiVersion"], answer["kind"]) == (
            "admission.k8s.io/v1", "AdmissionReview")
        assert answer["response"]["uid"] == bogus["request"]["uid"]
        assert answer["response"]["allowed"]


async def test_updates_of_made_up_uids_leave_no_memo_behind(tmp_path):
    """kopf kept a memo per UPDATE's object uid for the operator's lifetime (1.2 KiB each):
    4,000 such reviews, after 1,000 that settle the allocator, grow it by under 2 MiB."""
    def update(uid: int) -> dict:
        body = admission_review(LOCAL, operation="UPDATE", old_spec=LOCAL)
        for key in ("object", "oldObject"):
            body["request"][key]["metadata"]["uid"] = f"made-up-{uid}"
        return body

    async with emulated_cluster() as cluster, webhook_operator(cluster, tmp_path / "log") as client:
        async def send(first: int, count: int) -> None:
            gate = asyncio.Semaphore(8)

            async def one(uid: int) -> None:
                async with gate:
                    assert (await client.ask(update(uid)))["allowed"]

            await asyncio.gather(*(one(uid) for uid in range(first, first + count)))

        await send(0, 1000)
        base = rss_mib(client.pid)
        await send(1000, 4000)
        assert rss_mib(client.pid) - base < 2.0


@pytest.mark.parametrize(("kopf_says", "allowed", "code"), [
    ({"response": {"allowed": False, "status": {"code": 403, "message": "no node fits"}}},
     False, 403),
    ({"response": {"allowed": False, "status": {"code": 500, "message": "KeyError: 'x'"}}},
     True, None),
    ({"response": {"allowed": True, "warnings": ["on some nodes only"]}}, True, None),
    (None, True, None),
])
def test_only_a_verdict_refuses_and_a_fault_lets_the_resource_in(kopf_says, allowed, code):
    answer, fault = contract.answer("u-1", "llm", kopf_says)
    assert answer["apiVersion"] == "admission.k8s.io/v1" and answer["response"]["uid"] == "u-1"
    assert answer["response"]["allowed"] is allowed
    assert (answer["response"].get("status") or {}).get("code") == code
    if kopf_says is None or (code is None and not kopf_says["response"]["allowed"]):
        assert fault is not None
        assert answer["response"]["warnings"] == [
            "the webhook could not judge llm (a fault of its own): the pod's pre-flight "
            "checks the fit"]
