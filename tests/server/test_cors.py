"""Browsers' cross-origin requests (``server/cors.py``): off by default (no CORS header, a
preflight is any OPTIONS request: refused behind the key), served for the origins
``--allowed-origins`` names, preflights answered before the key is asked for, streamed
answers named too."""

from __future__ import annotations

import pytest
from _server_helpers import make_llm, model_name, start_app, stop_app

from kvledger.engine.errors import BadInput
from kvledger.engine.settings.serve_config import ServeConfig

PAGE = "https://app.example"
PREFLIGHT = {"Origin": PAGE, "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization, content-type"}


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return make_llm(tiny_llama_dir)


async def test_off_by_default_no_header_and_no_preflight(aiohttp_client, llm):
    client = await start_app(aiohttp_client, llm, api_keys=("k",))
    response = await client.options("/v1/completions", headers=PREFLIGHT)
    assert response.status == 401 and "Access-Control-Allow-Origin" not in response.headers
    response = await client.get("/health", headers={"Origin": PAGE})
    assert "Access-Control-Allow-Origin" not in response.headers


async def test_a_named_origin_is_served_and_another_is_not(aiohttp_client, llm):
    client = await start_app(aiohttp_client, llm, api_keys=("k",), allowed_origins=(PAGE,))
    response = await client.options("/v1/completions", headers=PREFLIGHT)
    assert response.status == 200  # before the key: a browser sends none with it
    assert response.headers["Access-Control-Allow-Origin"] == PAGE
    assert "POST" in response.headers["Access-Control-Allow-Methods"]
    assert response.headers["Access-Control-Allow-Headers"] == "authorization, content-type"
    refused = await client.options("/v1/completions",
                                   headers={**PREFLIGHT, "Origin": "https://evil.example"})
    assert refused.status == 400 and "Access-Control-Allow-Origin" not in refused.headers
    body = {"model": model_name(client), "prompt": "Once", "max_tokens": 2}
    for stream in (False, True):
        answer = await client.post("/v1/completions", json={**body, "stream": stream},
                                   headers={"Origin": PAGE, "Authorization": "Bearer k"})
        assert answer.status == 200
        assert answer.headers["Access-Control-Allow-Origin"] == PAGE
        await answer.read()
    unkeyed = await client.post("/v1/completions", json=body, headers={"Origin": PAGE})
    assert unkeyed.status == 401  # the key is still asked for; the browser may read why
    assert unkeyed.headers["Access-Control-Allow-Origin"] == PAGE
    other = await client.post("/v1/completions", json=body,
                              headers={"Origin": "https://evil.example",
                                       "Authorization": "Bearer k"})
    assert "Access-Control-Allow-Origin" not in other.headers


async def test_any_origin_is_a_star_unless_credentials_are_allowed(aiohttp_client, llm):
    star = await start_app(aiohttp_client, llm, allowed_origins=("*",))
    assert (await star.get("/health", headers={"Origin": PAGE})).headers[
        "Access-Control-Allow-Origin"] == "*"
    await stop_app(star)
    named = await start_app(aiohttp_client, llm, allowed_origins=("*",), allow_credentials=True,
                            allowed_methods=("POST",), allowed_headers=("content-type",))
    response = await named.options("/v1/completions", headers=PREFLIGHT)
    assert (response.headers["Access-Control-Allow-Origin"],
            response.headers["Access-Control-Allow-Credentials"],
            response.headers["Access-Control-Allow-Methods"],
            response.headers["Access-Control-Allow-Headers"]) == (PAGE, "true", "POST",
                                                                  "content-type")


def test_the_flags_read_vllms_json_lists():
    from kvledger.engine.cli import build_parser

    args = build_parser("serve").parse_args(
        ["--model", "m", "--allowed-origins", '["https://a", "https://b"]',
         "--allowed-methods", '["GET", "POST"]', "--allow-credentials"])
    assert (args.allowed_origins, args.allowed_methods, args.allow_credentials) == (
        ("https://a", "https://b"), ("GET", "POST"), True)
    with pytest.raises(BadInput, match="list of strings"):
        ServeConfig(allowed_origins=("",))
