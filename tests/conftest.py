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
