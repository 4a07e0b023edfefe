"""bench/hostile_cluster.py's sections on how the webhook is spoken to: connections that
handshake and say nothing, bodies that trickle, AdmissionReviews that are not, and UPDATEs
of made-up uids. Each starts its own operator."""

from __future__ import annotations

import asyncio
import functools
import json
import ssl
import time
from typing import Any

import aiohttp
from attack_tools import gather_limited, said, webhook
from hostile_clients import Peak, close_all, open_tcp, open_tls, rss_mib, status_of, still_open
from webhook_harness import SERVER_NAME, admission_review

# What the operator may grow by, whatever the clients do.
# ~0.3 MiB a TLS connection (asyncio's 256 KiB read buffer) and what aiohttp buffers of a
# body, for the 256 the server holds at most.
GROWTH_MIB = {"tls": 96, "bodies": 160}


async def tls_idle(args, report) -> None:
    tls_count, tcp_count = (300, 100) if args.fast else (1000, 200)
    wait_s = 20.0 if args.fast else 60.0
    async with webhook(args) as client:
        base = rss_mib(client.pid)
        with Peak(client.pid) as peak:
            tls = [s for s in await gather_limited(lambda: open_tls(client.port, client.trust),
                                                   tls_count) if s]
            tcp = [s for s in await gather_limited(
                lambda: open_tcp(client.port), tcp_count) if s]
            held_mib = rss_mib(client.pid) - base
            await asyncio.sleep(wait_s)
            open_tls_n, open_tcp_n = await still_open(tls), await still_open(tcp)
        answer = await client.ask(admission_review({"model": {"path": "/m"}, "gpus": 0}))
        close_all(tls + tcp)
    grown = peak.mib - base
    report.check(f"{tls_count} TLS connections that only handshake, {tcp_count} TCP ones "
                 "that never start TLS: operator memory",
                 f"+{grown:.0f} MiB at peak ({len(tls)} TLS handshakes done, +{held_mib:.0f} "
                 "MiB with them open)", f"under +{GROWTH_MIB['tls']} MiB",
                 grown < GROWTH_MIB["tls"])
    report.check("idle connections after the wait", f"{open_tls_n} TLS, {open_tcp_n} TCP still "
                 f"open after {wait_s:.0f} s; a review then: {said(answer)}",
                 "none open, the review answered", open_tls_n + open_tcp_n == 0)


async def slow_body(port: int, trust: ssl.SSLContext, length: int, sent: int) -> tuple | None:
    streams = await open_tls(port, trust)
    if streams is None:
        return None
    reader, writer = streams
    head = (f"POST /validate HTTP/1.1\r\nHost: {SERVER_NAME}\r\nContent-Type: application/json"
            f"\r\nContent-Length: {length}\r\n\r\n").encode()
    try:
        writer.write(head + b" " * sent)
        await asyncio.wait_for(writer.drain(), 10)
    except (TimeoutError, OSError):
        pass
    return reader, writer


async def slow_bodies(args, report) -> None:
    """As many connections send the head of a review and part of its body, then nothing:
    first bodies of 1 MB (over the cap: refused from their Content-Length), then of 120 kB
    (under it: they wait for the body's deadline)."""
    count = 500 if args.fast else 2000
    wait_s = 15.0 if args.fast else 45.0
    for length in (1_000_000, 120_000):
        async with webhook(args) as client:
            base = rss_mib(client.pid)
            with Peak(client.pid) as peak:
                streams = [s for s in await gather_limited(
                    functools.partial(slow_body, client.port, client.trust, length, 60_000),
                    count) if s]
                held_mib = rss_mib(client.pid) - base
                await asyncio.sleep(wait_s)
                seen = await status_of(streams)
            close_all(streams)
        grown = peak.mib - base
        report.check(f"{count} connections holding 60 kB of a {length // 1000} kB body: "
                     "operator memory", f"+{grown:.0f} MiB at peak (+{held_mib:.0f} MiB once "
                     f"sent); after {wait_s:.0f} s, of the {len(streams)} connected: {seen}",
                     f"under +{GROWTH_MIB['bodies']} MiB, none open",
                     grown < GROWTH_MIB["bodies"] and "open" not in seen)


# Python's own words, which a client should never read in an answer.
PYTHON_TEXT = ("Traceback", "object has no attribute", "NoneType", "KeyError", "TypeError",
               "AttributeError", "indices must be", "'list'", "'str'", "'dict'",
               "sequence element")


def malformed_bodies() -> dict[str, Any]:
    good = admission_review({"model": {"path": "/m"}, "gpus": 1})
    request = good["request"]

    def with_request(**changes: Any) -> dict:
        return dict(good, request=dict(request, **changes))

    def with_object(**changes: Any) -> dict:
        return with_request(object=dict(request["object"], **changes))

    return {"a list": [good], "null": None, "{}": {}, "request a string": dict(good, request="r"),
            "request a list": dict(good, request=[request]),
            "object a string": with_request(object="llm"),
            "metadata a string": with_object(metadata="llm"),
            "spec a list": with_object(spec=[{"gpus": 1}]),
            "not JSON": b"{\"apiVersion\": ", "a string body": "review"}


async def malformed_reviews(args, report) -> None:
    bodies = malformed_bodies()
    async with webhook(args) as client, aiohttp.ClientSession() as http:
        async def post(body: Any) -> tuple[int, str]:
            data = body if isinstance(body, bytes) else json.dumps(body).encode()
            async with http.post(f"https://127.0.0.1:{client.port}/validate", data=data,
                                 headers={"Content-Type": "application/json"},
                                 ssl=client.trust, server_hostname=SERVER_NAME) as response:
                return response.status, await response.text()

        seen: dict[str, int] = {}
        for body in bodies.values():
            status, text = await post(body)
            python = any(word in text for word in PYTHON_TEXT)
            allowed = ""
            if status == 200:
                response = json.loads(text)["response"]
                allowed = (" allowed" if response["allowed"]
                           else f" refused {response['status']['code']}")
            kind = f"{status}{allowed}{' with Python text' if python else ''}"
            seen[kind] = seen.get(kind, 0) + 1
        report.check(f"{len(bodies)} malformed AdmissionReview bodies ({', '.join(bodies)})",
                     ", ".join(f"{kind}: {n}" for kind, n in sorted(seen.items())),
                     "a 400 without Python text each", seen == {"400": len(bodies)})
        bogus = admission_review({"model": {"path": "/m"}, "gpus": 0})
        bogus |= {"apiVersion": "evil.example/v9", "kind": "Nonsense"}
        bogus["request"]["uid"] = {"not": "a string"}
        status, text = await post(bogus)
        answer = json.loads(text) if status == 200 else {}
        contract = (answer.get("apiVersion"), answer.get("kind"),
                    (answer.get("response") or {}).get("uid"))
        report.check("a review of apiVersion evil.example/v9, kind Nonsense, a dict uid",
                     f"{status}, answered as {contract}" if status == 200 else f"{status}",
                     "admission.k8s.io/v1 AdmissionReview, the uid not echoed (or a 400)",
                     status == 400 or (contract[:2] == ("admission.k8s.io/v1", "AdmissionReview")
                     and not isinstance(contract[2], dict)))


async def update_memos(args, report) -> None:
    count, warm = (10000, 1000) if args.fast else (50000, 2000)
    spec = {"model": {"path": "/m"}, "gpus": 1}

    def review() -> dict:
        body = admission_review(spec, operation="UPDATE", old_spec=spec)
        for key in ("object", "oldObject"):
            body["request"][key]["metadata"]["uid"] = body["request"]["uid"]
        return body

    async with webhook(args) as client:
        async def send(n: int) -> None:
            await gather_limited(lambda: client.ask(review()), n, at_once=8)

        await send(warm)  # the allocator's arenas and kopf's caches settle first
        base = rss_mib(client.pid)
        started = time.monotonic()
        await send(count)
        took = time.monotonic() - started
        grown = rss_mib(client.pid) - base
    # kopf's memo was ~1.2 KiB a uid; the claim allows a tenth of that.
    claim = max(1.0, count * 1.2 / 10 / 1024)
    report.check(f"{count} UPDATE reviews of made-up uids", f"+{grown:.1f} MiB kept "
                 f"({count / took:.0f} reviews/s)", f"under +{claim:.1f} MiB", grown < claim)
