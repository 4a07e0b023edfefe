"""The largest value that fits: the binary search itself at every threshold of a small
range, then --max-model-len, --max-num-seqs and --max-num-batched-tokens through
``make_plan`` on tiny header-only checkpoints (full attention, sliding+full, MLA), at
limits just enough for each value."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from budget_checkpoints import llama_shapes, write_config, write_header_only

from kvledger.engine.planner.plan import Plan, make_plan
from kvledger.engine.planner.remedies import largest_fitting
from kvledger.engine.settings.config import EngineConfig

GiB = 2**30


# --- the search ------------------------------------------------------------------------------

def _at_most(threshold: int, low: int, high: int, calls: list[int]):
    """fits(n) = n <= threshold; records each n asked and refuses to loop for ever."""

    def fits(n: int) -> bool:
        assert low <= n <= high, f"asked about {n}, outside [{low}, {high}]"
        calls.append(n)
        assert len(calls) <= 2 * (high - low + 1).bit_length() + 2, f"no end in sight: {calls}"
        return n <= threshold

    return fits


@pytest.mark.parametrize("low", [0, 1, 2, 5])
@pytest.mark.parametrize("width", range(1, 18))
def test_largest_fitting_finds_every_threshold(low: int, width: int) -> None:
    high = low + width - 1
    for threshold in range(low, high + 1):
        calls: list[int] = []
        found = largest_fitting(_at_most(threshold, low, high, calls), low, high)
        assert found == threshold, f"[{low}, {high}], fits up to {threshold}: asked {calls}"


@pytest.mark.parametrize("low", [0, 1, 2, 5])
@pytest.mark.parametrize("width", range(1, 18))
def test_largest_fitting_edges_nothing_fits_and_everything_fits(low: int, width: int) -> None:
    high = low + width - 1
    for threshold in (low - 1, low - 5):  # not even low fits
        assert largest_fitting(_at_most(threshold, low, high, []), low, high) is None
    for threshold in (high, high + 1, high + 100):  # all of [low, high] fits: the bound
        assert largest_fitting(_at_most(threshold, low, high, []), low, high) == high


def test_largest_fitting_of_an_empty_range_asks_nothing() -> None:
    assert largest_fitting(_at_most(10, 1, 0, []), 1, 0) is None
    assert largest_fitting(_at_most(10, 5, 3, []), 5, 3) is None


# --- through make_plan -------------------------------------------------------------------------

def _header_only_checkpoint(model_dir: Path, **overrides) -> None:
    """config.json and a safetensors header of a tiny Llama's bf16 tensors; no tensor data
    on disk (the file is left sparse), which is all the planner reads."""
    config = write_config(model_dir, **overrides)
    write_header_only(model_dir, config,
                      {name: ("BF16", shape) for name, shape in llama_shapes(config).items()})


# The tiny model's attention: full in kvledger's engine; a what-if for vLLM of sliding
# layers (window 40) among full ones, whose blocks also grow with the step; MLA's latent.
LAYOUTS = {
    "full": {},
    "sliding+full": {"architectures": ["Gemma2ForCausalLM"], "sliding_window": 40,
                     "num_hidden_layers": 3},
    "mla": {"architectures": ["DeepseekV2ForCausalLM"], "kv_lora_rank": 24,
            "qk_rope_head_dim": 8, "qk_nope_head_dim": 16},
}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def tiny_dir(request, tmp_path_factory: pytest.TempPathFactory) -> str:
    model_dir = tmp_path_factory.mktemp("header-only")
    _header_only_checkpoint(model_dir, **LAYOUTS[request.param])  # max_position_embeddings 512
    layout = make_plan(_config(str(model_dir)), with_remedies=False).kv.layout
    assert layout == {"sliding+full": "sliding+full (hybrid)"}.get(request.param, request.param)
    return str(model_dir)


def _config(model_dir: str, **flags) -> EngineConfig:
    # A what-if 80 GiB device: the limit is --memory-limit, the pool all that is left under it.
    return EngineConfig(model=model_dir, device_memory_bytes=80 * GiB, **flags)


def _fits(config: EngineConfig, **changes) -> bool:
    return make_plan(dataclasses.replace(config, **changes), with_remedies=False).fits


def _just_enough_bytes(config: EngineConfig, **changes) -> int:
    """The smallest --memory-limit under which ``config`` with ``changes`` fits: every
    class but the KV pool, plus the pool of the declared workload."""
    p: Plan = make_plan(dataclasses.replace(config, memory_limit_bytes=1000 * GiB, **changes),
                        with_remedies=False)
    return p.required_bytes - p.classes["kv_cache"] + p.kv.required_blocks * p.kv.bytes_per_block


def _remedy(plan: Plan, flag: str) -> int | None:
    values = [r.value for r in plan.remedies if r.flag == flag]
    return values[0] if values else None


@pytest.mark.parametrize("block_size", [1, 16])
def test_max_model_len_remedy_fits_and_one_token_more_does_not(tiny_dir, block_size) -> None:
    """A sweep of limits (uneven steps, so the answer lands on many values, in and out of
    whole blocks): the remedy fits, one token more does not; no remedy, nothing fits."""
    base = _config(tiny_dir, max_model_len=512, max_num_seqs=2, block_size=block_size)
    low, high = _just_enough_bytes(base, max_model_len=1), _just_enough_bytes(base)
    seen = set()
    for limit in range(low - 3000, high + 3000, 4099):
        p = make_plan(dataclasses.replace(base, memory_limit_bytes=limit))
        best = _remedy(p, "--max-model-len")
        if p.fits:
            assert best is None
            continue
        if best is None:
            assert not _fits(p.config, max_model_len=1)
            continue
        seen.add(best)
        assert 1 <= best < 512
        assert _fits(p.config, max_model_len=best), f"limit {limit}: {best} does not fit"
        assert not _fits(p.config, max_model_len=best + 1), f"limit {limit}: {best + 1} fits too"
    assert len(seen) > 20


@pytest.mark.parametrize("target", [1, 2, 3, 16, 17, 255, 256, 257, 509, 510, 511])
def test_max_model_len_remedy_is_exactly_the_length_the_limit_was_cut_for(tiny_dir,
                                                                          target) -> None:
    """block_size 1, so every token is a threshold: a limit just enough for ``target``
    tokens gives ``target``; one byte less gives ``target - 1`` (or nothing, at 1)."""
    base = _config(tiny_dir, max_model_len=512, max_num_seqs=2, block_size=1)
    limit = _just_enough_bytes(base, max_model_len=target)
    just = make_plan(dataclasses.replace(base, memory_limit_bytes=limit))
    assert not just.fits and _remedy(just, "--max-model-len") == target
    short = make_plan(dataclasses.replace(base, memory_limit_bytes=limit - 1))
    assert _remedy(short, "--max-model-len") == (target - 1 if target > 1 else None)


@pytest.mark.parametrize("target", [1, 2, 3, 6, 7])
def test_max_num_seqs_remedy_is_exactly_the_count_the_limit_was_cut_for(tiny_dir,
                                                                       target) -> None:
    base = _config(tiny_dir, max_model_len=256, max_num_seqs=8)
    limit = _just_enough_bytes(base, max_num_seqs=target)
    just = make_plan(dataclasses.replace(base, memory_limit_bytes=limit))
    assert not just.fits and _remedy(just, "--max-num-seqs") == target
    assert _fits(just.config, max_num_seqs=target)
    assert not _fits(just.config, max_num_seqs=target + 1)
    short = make_plan(dataclasses.replace(base, memory_limit_bytes=limit - 1))
    assert _remedy(short, "--max-num-seqs") == (target - 1 if target > 1 else None)


@pytest.mark.parametrize("target", [4, 5, 6, 4096, 500_000, 999_998, 999_999])
def test_max_num_batched_tokens_remedy_is_exactly_the_step_the_limit_was_cut_for(
        tiny_dir, target) -> None:
    """A step of a million tokens: activations dominate and the smaller step is offered,
    never below --max-num-seqs (4)."""
    base = _config(tiny_dir, max_model_len=256, max_num_seqs=4,
                   max_num_batched_tokens=1_000_000)
    limit = _just_enough_bytes(base, max_num_batched_tokens=target)
    just = make_plan(dataclasses.replace(base, memory_limit_bytes=limit))
    assert not just.fits and _remedy(just, "--max-num-batched-tokens") == target
    short = make_plan(dataclasses.replace(base, memory_limit_bytes=limit - 1))
    assert _remedy(short, "--max-num-batched-tokens") == (target - 1 if target > 4 else None)


# --- the checkpoint counted once per search --------------------------------------------------

def test_a_refusals_remedy_search_counts_the_checkpoints_tensors_once_per_shape(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A refusal plans the run at a hundred other shapes; the loaded bytes of one checkpoint
    at one dtype and GPU count are counted once (they were counted per plan: 1.4 s of a
    70B's two refusals in the webhook), and each answer is what a fresh count gives."""
    from kvledger.engine.checkpoint.contents import read_weights
    from kvledger.engine.planner import weight_bytes

    _header_only_checkpoint(tmp_path, hidden_size=512, intermediate_size=1024,
                            num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8,
                            vocab_size=4096, max_position_embeddings=4096)
    counted: list[tuple] = []
    real = weight_bytes._counted
    monkeypatch.setattr(weight_bytes, "_counted",
                        lambda *args: counted.append(args[1:]) or real(*args))
    full = make_plan(_config(str(tmp_path), max_model_len=2048, max_num_seqs=64,
                             memory_limit_bytes=1000 * GiB), with_remedies=False)
    counted.clear()
    plan = make_plan(dataclasses.replace(full.config, memory_limit_bytes=full.required_bytes // 2))
    assert not plan.fits and plan.remedies, (plan.fits, plan.remedies)
    assert len(counted) == len(set(counted)), counted
    weights = read_weights(tmp_path)
    for dtype, shape_, fp8, tp in set(counted):
        fresh = real(weights, dtype, shape_, fp8, tp)
        assert weight_bytes.loaded_weight_bytes(weights, dtype, shape=shape_, quantize_fp8=fp8,
                                                tensor_parallel_size=tp) == fresh
