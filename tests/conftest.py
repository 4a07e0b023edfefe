"""Shared fixtures: built-in checkpoints written once per test session.

``tiny_llama_dir``: a written ``tiny-llama`` checkpoint directory.
``make_model_dir(name)``: the directory of any built-in model (``kvledger make-model``
names), written on first use and reused for the rest of the session.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

# Triton kernels (engine/model/paged_attention.py) run on the CPU under Triton's
# interpreter; it must be chosen before triton is first imported.
os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def make_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    from kvledger.engine.model.builtin import write_model

    written: dict[str, Path] = {}

    def make(name: str) -> Path:
        if name not in written:
            written[name] = write_model(name, tmp_path_factory.mktemp("models") / name)
        return written[name]

    return make


@pytest.fixture(scope="session")
def tiny_llama_dir(make_model_dir: Callable[[str], Path]) -> Path:
    return make_model_dir("tiny-llama")


@pytest.fixture(scope="session")
def sharded_tiny_llama_dir(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny-llama in two shards with an index, as transformers writes a larger model."""
    import json

    from safetensors.torch import load_file, save_file

    tensors = load_file(str(tiny_llama_dir / "model.safetensors"))
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    folder = tmp_path_factory.mktemp("sharded") / "tiny-llama"
    folder.mkdir()
    for p in tiny_llama_dir.iterdir():
        if p.name != "model.safetensors":
            (folder / p.name).write_bytes(p.read_bytes())
    for file, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(folder / file), metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {k: f for f, keys in shards.items() for k in keys}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return folder
