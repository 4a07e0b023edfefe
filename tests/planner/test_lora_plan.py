"""The planner counts the LoRA adapter slots the engine preallocates (``--enable-lora``):
``max_loras x max_lora_rank x (in + out) x dtype bytes`` for each of the q, k, v, o, gate,
up and down projections of every layer, as a class of its own (``lora``) in the
breakdown and the plan JSON; the KV pool is what it was (adapters add no KV)."""

from __future__ import annotations

import pytest
from test_plan import GPU_80, plan

from kvledger.engine.planner.report import render_report

MiB = 2**20


def test_lora_slots_are_a_class_of_their_own() -> None:
    base = plan(max_model_len=4096, max_num_seqs=8)
    lora = plan(max_model_len=4096, max_num_seqs=8, enable_lora=True, max_loras=4,
                max_lora_rank=16)
    # Llama-3-8B, bf16: per layer q 4096+4096, k and v 4096+1024, o 4096+4096, gate and
    # up 4096+14336, down 14336+4096 = 81,920; x rank 16 x 4 slots x 32 layers x 2 bytes.
    assert lora.classes["lora"] == 81_920 * 16 * 4 * 32 * 2 == 320 * MiB
    assert base.classes["lora"] == 0
    assert lora.kv == base.kv  # the ledger is unchanged
    assert lora.required_bytes == base.required_bytes + 320 * MiB
    assert lora.to_json()["classes"]["lora"] == 320 * MiB
    assert "LoRA adapters" in render_report(lora) and "4 slots x rank 16" in render_report(lora)
    assert "LoRA" not in render_report(base)


def test_lora_slots_shrink_the_pool_under_a_cap() -> None:
    # Seats declared: left to the pool, fewer would run beside the slots (test_plan.py).
    base = plan(max_model_len=4096, max_num_seqs=16, gpu_memory_utilization=0.9, device=GPU_80)
    lora = plan(max_model_len=4096, max_num_seqs=16, gpu_memory_utilization=0.9, device=GPU_80,
                enable_lora=True, max_loras=8, max_lora_rank=64)
    assert lora.classes["lora"] == 81_920 * 64 * 8 * 32 * 2
    assert lora.kv.num_blocks == base.kv.num_blocks - lora.classes["lora"] // base.kv.bytes_per_block


@pytest.mark.parametrize("rank", [3, 1024])
def test_max_lora_rank_is_one_of_vllms(rank) -> None:
    from kvledger.engine.errors import BadInput

    with pytest.raises(BadInput, match=f"--max-lora-rank {rank}: must be one of"):
        plan(enable_lora=True, max_lora_rank=rank)


def test_lora_flags_round_trip_and_parse_vllms_forms() -> None:
    import argparse

    from kvledger.engine.settings.config import EngineConfig
    from kvledger.engine.settings.config_flags import add_engine_flags, config_from_args
    from kvledger.engine.settings.lora_config import LoraModule

    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    config = config_from_args(parser.parse_args([
        "/m", "--enable-lora", "--max-loras", "2", "--max-lora-rank", "64",
        "--max-cpu-loras", "3", "--lora-modules", "sql=/a/sql",
        '{"name": "chat", "path": "hf://org/chat", "base_model_name": "llama"}']))
    assert config.lora_modules == (LoraModule("sql", "/a/sql"),
                                   LoraModule("chat", "hf://org/chat", "llama"))
    assert (config.max_loras, config.max_lora_rank, config.max_cpu_loras) == (2, 64, 3)
    assert config_from_args(parser.parse_args(config.to_flags())) == config
    assert EngineConfig(model="/m").to_flags() == ["--model", "/m"]


@pytest.mark.parametrize(("argv", "message"), [
    (["--enable-lora", "--lora-modules", "nopath"], "expected NAME=PATH or JSON"),
    (["--enable-lora", "--lora-modules", '{"name": "x"}'], "the JSON form is"),
    (["--lora-modules", "a=/a"], "--lora-modules needs --enable-lora"),
    (["--enable-lora", "--max-loras", "0"], "--max-loras must be a positive integer"),
    (["--enable-lora", "--lora-target-modules", "q_proj"], "restricting LoRA to some modules"),
    (["--enable-lora", "--lora-dtype", "float16"], "another dtype for LoRA adapters"),
])
def test_bad_lora_flags_are_one_line_exit_2(argv, message, tmp_path, capsys) -> None:
    from kvledger.engine.cli import main

    assert main(["plan", str(tmp_path), *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err


def test_the_pre_flight_refuses_lora_where_the_engine_would(make_model_dir, capsys) -> None:
    """What the engine refuses at start-up (LoRA on a mixture of experts, LoRA with
    tensor parallelism), the plan refuses first, by name (exit 2): never "fits", then an
    engine that exits."""
    from kvledger.engine.cli import main

    cases = ((make_model_dir("tiny-mixtral"), [], "is a mixture of experts"),
             (make_model_dir("tiny-llama"), ["-tp", "2"],
              "does not serve LoRA adapters with --tensor-parallel-size 2 yet"))
    for model_dir, extra, why in cases:
        assert main(["plan", str(model_dir), "--device", "cpu", "--enable-lora", *extra]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: --enable-lora: ") and why in err and err.count("\n") == 1
    assert main(["plan", str(make_model_dir("tiny-llama")), "--device", "cpu",
                 "--enable-lora"]) == 0


def test_the_pre_flight_reads_every_adapter_it_will_load(make_model_dir, tmp_path,
                                                         capsys) -> None:
    """A missing adapter, or one over --max-lora-rank, fails the pre-flight (the pod's init
    container) by name, exit 2, instead of the engine after its model has loaded."""
    from _lora_helpers import write_adapter

    from kvledger.engine.cli import main

    model = make_model_dir("tiny-llama")
    good = write_adapter(tmp_path / "good", model, rank=8)
    base = ["preflight", str(model), "--device", "cpu", "--enable-lora", "--max-lora-rank",
            "16", "--termination-log", str(tmp_path / "log")]
    assert main([*base, "--lora-modules", f"sql={good}"]) == 0, capsys.readouterr().err
    capsys.readouterr()
    for modules, why in (([f"sql={good}", f"chat={tmp_path / 'missing'}"],
                          "LoRA adapter 'chat' "),
                         ([f"big={write_adapter(tmp_path / 'big', model, rank=32)}"],
                          "rank 32 is over --max-lora-rank 16")):
        assert main([*base, "--lora-modules", *modules]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and why in err and err.count("\n") == 1, err
    # hf:// adapters are read when the engine fetches them
    assert main([*base, "--lora-modules", "hub=hf://org/adapter"]) == 0
