"""The admission webhook's HTTPS server: kopf's review handling (the ``fn`` kopf hands a
server, ``settings.admission.server``) behind the limits a server the whole cluster can
reach must have. kopf's own ``WebhookServer`` had none: 1,000 connections that only
completed TLS held 301 MiB for as long as they liked, and 2,000 holding 60 kB of a 1 MB
body took the operator from 70 MiB to over 1 GiB.

- Connections: at most ``MAX_CONNECTIONS`` at once (one past them is closed as it is
  accepted, before TLS: ~280 KiB each); a TLS handshake within ``HANDSHAKE_TIMEOUT_S``; a
  request's headers within ``HEADER_TIMEOUT_S`` of its first byte (the first one's: of the
  handshake); ``IDLE_TIMEOUT_S`` between requests (the API server keeps its connections
  and opens a new one when we close it). ``engine/slow_clients.py`` is the engine's server's.
- Bodies: ``MAX_BODY_BYTES`` (413 before reading, from the Content-Length), read within
  ``BODY_TIMEOUT_S`` (408). An InferenceService's AdmissionReview is a few KiB: an UPDATE
  of any of examples/, with both copies of the object, kubectl's last-applied annotation
  and managed fields, is under 5 KiB. The cap leaves room for twenty-five times that, and
  keeps what the connections may hold at once to ~150 MiB (a TLS connection ~280 KiB, a
  body being read about twice its size: 255 connections each 125 kB into a 131 kB body
  held 153 MiB, at 256 KiB it was 196 MiB); a review over it fails as an unreachable
  webhook does (its ``failurePolicy``).
- The contract (``admission_review``): a body that is not a review is a 400 with one line;
  the answer is always ``admission.k8s.io/v1``'s.
- The deadline: a review is answered by ``timeout_s`` (the configuration's
  ``timeoutSeconds``) less ``answer_margin_s`` from its arrival. The handler reads that
  time from ``ANSWER_BY``; should kopf not answer by then, the server answers itself,
  allowed with a warning.
"""

from __future__ import annotations

import asyncio
import base64
import contextvars
import hashlib
import logging
import ssl
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from aiohttp import web

from kvledger.engine import json_text
from kvledger.engine.slow_clients import CappedSite, limited_runner
from kvledger.operator.webhook import admission_review
from kvledger.operator.webhook.admission_review import NotAReview

MAX_CONNECTIONS = 256
HANDSHAKE_TIMEOUT_S = 5.0
HEADER_TIMEOUT_S = 5.0
BODY_TIMEOUT_S = 5.0
IDLE_TIMEOUT_S = 30.0
MAX_BODY_BYTES = 128 * 1024
# What a review's answer keeps back from the API server's timeoutSeconds for its way back
# (a quarter of a timeout under 4 s).
ANSWER_MARGIN_S = 1.0
CERT_CHECK_S = 60.0  # how often the certificate files are looked at for a renewal
# A review's answer is due by this time.monotonic() (set per review, read by the handler).
ANSWER_BY: contextvars.ContextVar[float] = contextvars.ContextVar("kvledger_answer_by")

log = logging.getLogger("kvledger.webhook")


def answer_margin_s(timeout_s: float) -> float:
    return min(ANSWER_MARGIN_S, timeout_s / 4)


class WebhookServer:
    """kopf's admission server (``settings.admission.server``): called with kopf's review
    function, it serves until cancelled and yields the client configuration once."""

    def __init__(self, *, port: int, certfile: Path, keyfile: Path, cadata: bytes | None,
                 timeout_s: float, path: str, addr: str = "0.0.0.0") -> None:
        self.port, self.addr, self.path = port, addr, path
        self.certfile, self.keyfile, self.cadata = certfile, keyfile, cadata
        self.timeout_s = timeout_s
        self.site: CappedSite | None = None

    async def __call__(self, fn: Callable[..., Any]) -> AsyncIterator[dict[str, str]]:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(self.certfile, self.keyfile)
        app = web.Application(client_max_size=MAX_BODY_BYTES)

        async def serve(request: web.Request) -> web.Response:
            return await self._review(fn, request)

        app.router.add_post(self.path, serve)
        runner = limited_runner(app, header_timeout_s=HEADER_TIMEOUT_S,
                                keepalive_timeout=IDLE_TIMEOUT_S, access_log=None,
                                handle_signals=False, shutdown_timeout=1.0)
        await runner.setup()
        try:
            self.site = CappedSite(runner, self.addr, self.port, ssl_context=context,
                                   max_connections=MAX_CONNECTIONS,
                                   handshake_timeout_s=HANDSHAKE_TIMEOUT_S)
            await self.site.start()
            config = {"url": f"https://{self.addr}:{self.port}{self.path}"}
            if self.cadata:
                config["caBundle"] = base64.b64encode(self.cadata).decode()
            yield config
            seen = self._digest()
            while True:  # a renewed certificate is loaded in place: new handshakes get it
                await asyncio.sleep(CERT_CHECK_S)
                if (now := self._digest()) != seen:
                    context.load_cert_chain(self.certfile, self.keyfile)
                    seen = now
        finally:
            await runner.cleanup()

    def _digest(self) -> str:
        return hashlib.sha256(Path(self.certfile).read_bytes()
                              + Path(self.keyfile).read_bytes()).hexdigest()

    async def _review(self, fn: Callable[..., Any], request: web.Request) -> web.Response:
        answer_by = time.monotonic() + self.timeout_s - answer_margin_s(self.timeout_s)
        # With --verbose: where the reviews come from (the chart's NetworkPolicy needs it).
        log.debug(f"a review from {request.remote}")
        if request.content_length is None:
            return _refusal(411, "an AdmissionReview is sent with its Content-Length")
        if request.content_length > MAX_BODY_BYTES:
            return _refusal(413, f"an AdmissionReview is at most {MAX_BODY_BYTES // 1024} KiB")
        try:
            async with asyncio.timeout(BODY_TIMEOUT_S):
                raw = await request.read()
            uid, name, review = admission_review.for_kopf(json_text.loads(raw))
        except TimeoutError:
            return _refusal(408, f"the body did not arrive within {BODY_TIMEOUT_S:g} s")
        except (ValueError, UnicodeDecodeError):
            return _refusal(400, "not an AdmissionReview: the body is not JSON")
        except NotAReview as exc:
            return _refusal(400, str(exc))
        ANSWER_BY.set(answer_by)
        try:
            # kopf answers by answer_by (the handler's own deadline), else the server does.
            async with asyncio.timeout(max(0.0, answer_by - time.monotonic())
                                       + answer_margin_s(self.timeout_s) / 2):
                response = await fn(review, webhook=self.path.strip("/"),
                                    headers=dict(request.headers), sslpeer=None)
        except TimeoutError:
            log.warning(f"the review of {name} was not judged within its deadline")
            return web.json_response(admission_review.fault(uid, name, "not within its deadline"))
        except Exception:  # kopf's own (a review of a resource it has no handler for)
            log.exception(f"the review of {name} failed")
            return web.json_response(admission_review.fault(uid, name, "a fault of its own"))
        answer, fault = admission_review.answer(uid, name, response)
        if fault is not None:
            log.error(f"the webhook could not judge {name}: {fault}")
        return web.json_response(answer)


def _refusal(status: int, line: str) -> web.Response:
    return web.Response(status=status, text=line + "\n")
