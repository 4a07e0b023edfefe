"""Until the engine runs ranks, --tensor-parallel-size above 1 is planned per GPU by plan
and preflight but refused by name (exit 2) by the engine: serve and LLM(...)."""

from __future__ import annotations

import pytest

from kvledger.engine.cli import main
from kvledger.engine.errors import BadInput
from kvledger.engine.llm import LLM


def test_serve_refuses_more_than_one_rank_by_name(tiny_llama_dir, capsys) -> None:
    assert main(["serve", str(tiny_llama_dir), "--device", "cpu", "-tp", "2"]) == 2
    err = capsys.readouterr().err
    assert "--tensor-parallel-size 2: kvledger's engine does not run tensor parallelism" in err


def test_llm_refuses_more_than_one_rank_by_name(tiny_llama_dir) -> None:
    with pytest.raises(BadInput, match="--tensor-parallel-size 2: kvledger's engine"):
        LLM(str(tiny_llama_dir), device="cpu", tensor_parallel_size=2)
