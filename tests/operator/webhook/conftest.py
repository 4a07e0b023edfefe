"""Fixtures the webhook's tests share."""

from __future__ import annotations

import json

import pytest
from hub_server import HubServer


@pytest.fixture(scope="module")
def hub(make_model_dir, tmp_path_factory):
    """A hub of three models: small-llama, a gated tiny-llama (token hf_x), and one of an
    architecture the engine does not serve. Modules with a ``hub`` of their own keep it."""
    with HubServer() as server:
        server.add_commit("org/small-llama", make_model_dir("small-llama"))
        server.add_commit("org/gated", make_model_dir("tiny-llama"), token="hf_x")
        odd = tmp_path_factory.mktemp("odd")
        for item in make_model_dir("tiny-llama").iterdir():
            (odd / item.name).write_bytes(item.read_bytes())
        config = json.loads((odd / "config.json").read_text())
        (odd / "config.json").write_text(json.dumps(
            config | {"architectures": ["NoSuchForCausalLM"], "model_type": "no_such"}))
        server.add_commit("org/unsupported", odd)
        yield server
