"""One request's failure inside the engine over HTTP: that client gets a 500 (whole) or an
SSE error event and ``[DONE]`` (stream), the other clients never notice, every block comes
back, ``/health`` stays 200, and ``kvledger_requests_failed_total`` counts it."""

from __future__ import annotations

import asyncio
import json

import pytest
from _server_helpers import make_llm, metric, model_name, start_app

FAULT_SEED = 4242
FAILED = "kvledger_requests_failed_total"


@pytest.fixture
def llm(tiny_llama_dir, monkeypatch):
    """An engine whose sampler fails requests seeded FAULT_SEED at their third token."""
    llm = make_llm(tiny_llama_dir)
    real = llm.sampler

    def sampler(logits, seqs):
        if any(s.params.seed == FAULT_SEED and len(s.output_token_ids) == 2 for s in seqs):
            raise RuntimeError("injected sampling fault")
        return real(logits, seqs)

    monkeypatch.setattr(llm, "sampler", sampler)
    return llm


def _body(client, stream: bool, **extra) -> dict:
    return {"model": model_name(client), "prompt": "The river flows", "max_tokens": 24,
            "temperature": 0, "ignore_eos": True, "stream": stream, **extra}


async def _stream_events(response) -> list[bytes]:
    return [line[6:].strip() for line in (await response.read()).split(b"\n")
            if line.startswith(b"data: ")]


@pytest.mark.parametrize("stream", [False, True])
async def test_a_failed_request_gets_a_500_and_the_others_complete(aiohttp_client, llm, stream):
    client = await start_app(aiohttp_client, llm)
    alone = await (await client.post("/v1/completions", json=_body(client, False))).json()
    bad = _body(client, stream, seed=FAULT_SEED, temperature=0.7)
    answers = await asyncio.gather(
        client.post("/v1/completions", json=bad),
        *(client.post("/v1/completions", json=_body(client, False)) for _ in range(5)),
        client.get("/health"))
    failed, *others, health = answers
    if stream:
        assert failed.status == 200  # the headers went out before the fault
        events = await _stream_events(failed)
        assert events[-1] == b"[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == "request_error"
    else:
        assert failed.status == 500
        error = (await failed.json())["error"]
        assert error["code"] == "request_error" and error["type"] == "server_error"
    assert "injected sampling fault" in error["message"]
    for answer in others:
        assert answer.status == 200
        body = await answer.json()
        assert body["choices"][0]["text"] == alone["choices"][0]["text"]  # token-exact
    assert health.status == 200 and (await client.get("/health")).status == 200
    assert await metric(client, "kvledger_kv_blocks_reserved") == 0
    assert await metric(client, FAILED, 'reason="request_error"') == 1
    assert await metric(client, "kvledger_requests_rejected_total",
                        'reason="request_error"') == 0
