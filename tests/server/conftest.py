"""Fixtures the server tests share."""

from __future__ import annotations

import pytest
from _server_helpers import start_sdk


@pytest.fixture
async def sdk_serve(aiohttp_server, llm):
    """``await sdk_serve(**options)``: the module's ``llm`` served over real HTTP with
    ``options``, and an OpenAI SDK client on it (``start_sdk``), closed at the end."""
    clients = []

    async def start(**options):
        return await start_sdk(aiohttp_server, llm, clients, **options)

    yield start
    for client in clients:
        await client.close()
