"""The shared engine flags: SIZE parsing, validation, and the flags round trip."""

from __future__ import annotations

import argparse

import pytest

from kvledger.engine.errors import BadInput
from kvledger.engine.settings.config import EngineConfig
from kvledger.engine.settings.config_flags import add_engine_flags, config_from_args
from kvledger.engine.settings.kinds import parse_size


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("40GiB", 40 * 2**30),
        ("40Gi", 40 * 2**30),
        ("40GB", 40 * 10**9),
        ("40G", 40 * 10**9),
        ("512MiB", 512 * 2**20),
        ("512Mi", 512 * 2**20),
        ("1.5GiB", int(1.5 * 2**30)),
        ("1024", 1024),
        ("1024B", 1024),
        ("2Ti", 2 * 2**40),
        ("100k", 100_000),
        (" 8 GiB ", 8 * 2**30),
    ],
)
def test_parse_size_accepts_kubernetes_quantities(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "-1GiB", "40 gigs", "1.5", "4XB", "1e9"])
def test_parse_size_rejects_garbage(text: str) -> None:
    with pytest.raises(BadInput):
        parse_size(text)


def _parse(argv: list[str]) -> EngineConfig:
    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    return config_from_args(parser.parse_args(argv))


def test_flags_round_trip_through_to_flags() -> None:
    config = _parse([
        "--model", "/m", "--max-model-len", "4096", "--max-num-seqs", "4",
        "--memory-limit", "40GiB", "--gpu-memory-utilization", "0.85",
        "--kv-cache-dtype", "fp8", "--enforce-eager", "--device-memory", "80GiB",
        "--unified-memory",
    ])
    assert config.memory_limit_bytes == 40 * 2**30
    assert _parse(config.to_flags()) == config


def test_defaults_render_no_flags_but_the_model() -> None:
    assert EngineConfig(model="/m").to_flags() == ["--model", "/m"]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"gpu_memory_utilization": 0.0},
        {"gpu_memory_utilization": 1.5},
        {"max_model_len": 0},
        {"max_num_seqs": -2},
        {"block_size": 0},
        {"dtype": "int3"},
        {"kv_cache_dtype": "fp4"},
        {"device_free_bytes": 10},
        {"device_memory_bytes": 5, "device_free_bytes": 10},
        {"model": ""},
        {"max_num_seqs": 64, "max_num_batched_tokens": 32},
    ],
)
def test_config_rejects_bad_values(kwargs: dict) -> None:
    kwargs = {"model": "/m", **kwargs}
    with pytest.raises(BadInput):
        EngineConfig(**kwargs)


@pytest.mark.parametrize(
    "argv",
    [
        ["--model", "/m", "--gpu-memory-utilization", "1.2"],
        ["--model", "/m", "--gpu-memory-utilization", "abc"],
        ["--model", "/m", "--memory-limit", "lots"],
        ["--model", "/m", "--max-model-len", "-5"],
    ],
)
def test_bad_flags_exit_2(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        _parse(argv)
    assert exc.value.code == 2


@pytest.mark.parametrize(("argv", "flag"), [
    (["--memory-limit", "0"], "--memory-limit"),
    (["--device-memory", "0"], "--device-memory"),
    (["--kv-cache-memory-bytes", "0"], "--kv-cache-memory-bytes"),
])
def test_a_zero_size_names_the_flag_the_user_typed(argv: list[str], flag: str) -> None:
    with pytest.raises(BadInput, match=f"^{flag} must be a positive integer, got 0$"):
        config_from_args(_parse(["--model", "/m", *argv]))


def test_help_compares_the_workload_defaults_with_vllms() -> None:
    """Our 16 sequences without a cap is far below vLLM's default: --help says so, and that
    under a cap the pool decides, bounded by vLLM's default."""
    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    text = " ".join(parser.format_help().split())
    assert ("Not given: under a cap, as many max_model_len sequences as the KV pool left "
            "under it holds, at most vllm serve's default (256, 1024 on a GPU of 70 GiB or "
            "more other than an A100, 128 on a CPU); without a cap or with an explicit pool, "
            "16") in text
    assert "(default max(max_model_len, 2048): a whole prompt is one step; vllm serve's is 2048" in text
