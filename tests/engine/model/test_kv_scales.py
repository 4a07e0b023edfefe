"""``--kv-cache-dtype fp8`` with the checkpoint's KV cache scales (``self_attn.k_scale`` /
``v_scale``, a compressed-tensors ``kv_cache_scheme``): the cache holds ``K / k_scale`` and
``V / v_scale`` in e4m3, and attention multiplies them back.

What is compared: a checkpoint A with scales ``s_k``, ``s_v`` (powers of two, so every
product below is exact) against the same model B rewritten so that its keys and values are
already divided by them (``k_proj``, ``v_proj`` / s, ``q_proj`` * s_k and ``o_proj`` * s_v,
which leave its outputs unchanged) and no scales. If the engine divides on writing and
multiplies on reading, both caches hold the same fp8 bits and both give the same tokens;
dropping either half breaks one of the two."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from _fp8_checkpoints import write_fp8
from safetensors.torch import load_file, save_file

from kvledger.engine import LLM, SamplingParams
from kvledger.engine.errors import BadInput
from kvledger.engine.model.loader import weights_bytes
from kvledger.engine.planner.plan import make_plan
from kvledger.engine.settings.config import EngineConfig

FLAGS = {"max_model_len": 128, "max_num_seqs": 3, "device": "cpu", "dtype": "float32",
         "kv_cache_dtype": "fp8", "enable_prefix_caching": False}
K_SCALE, V_SCALE = 2.0**-5, 2.0**-4  # small: many keys and values saturate unscaled
PROMPTS = [[5 + (i * 13 + j * 7) % 1000 for j in range(n)] for i, n in enumerate((3, 20, 45))]


def _rewrite(source, out, edit) -> None:
    shutil.copytree(source, out)
    state = load_file(str(source / "model.safetensors"))
    edit(state)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})


def _with_scales(state: dict) -> None:
    for layer in {n.split(".")[2] for n in state if n.startswith("model.layers.")}:
        state[f"model.layers.{layer}.self_attn.k_scale"] = torch.tensor(K_SCALE)
        state[f"model.layers.{layer}.self_attn.v_scale"] = torch.tensor(V_SCALE)


def _prescaled(state: dict) -> None:
    for name in list(state):
        factor = {"q_proj": K_SCALE, "k_proj": 1 / K_SCALE, "v_proj": 1 / V_SCALE,
                  "o_proj": V_SCALE}.get(name.split(".")[-2])
        if factor is not None and name.endswith(".weight"):
            state[name] = state[name] * factor


def _run(model_dir) -> tuple[list[list[int]], torch.Tensor, LLM]:
    llm = LLM(str(model_dir), **FLAGS)
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12))
    cache = llm.engine.runner.kv_cache
    return [o.token_ids for o in outputs], cache.view(torch.uint8).clone(), llm


def test_fp8_kv_cache_divides_by_the_checkpoints_scales_and_multiplies_back(tmp_path,
                                                                           tiny_llama_dir):
    _rewrite(tiny_llama_dir, tmp_path / "scaled", _with_scales)
    _rewrite(tiny_llama_dir, tmp_path / "prescaled", _prescaled)
    tokens, cache, llm = _run(tmp_path / "scaled")
    attention = llm.engine.runner.model.model.layers[0].self_attn
    assert (attention.k_scale, attention.v_scale) == (K_SCALE, V_SCALE)
    planned = make_plan(EngineConfig(model=str(tmp_path / "scaled"), **FLAGS)).classes["weights"]
    assert weights_bytes(llm.engine.runner.model) == planned  # the scales are numbers
    prescaled_tokens, prescaled_cache, _ = _run(tmp_path / "prescaled")
    assert torch.equal(cache, prescaled_cache)  # divided on writing
    assert tokens == prescaled_tokens            # multiplied back on reading
    _, unscaled_cache, _ = _run(tiny_llama_dir)
    assert not torch.equal(cache, unscaled_cache)


def test_scales_are_ignored_without_an_fp8_cache(tmp_path, tiny_llama_dir):
    """As vLLM does: a float cache holds K and V as they are, whatever the scales."""
    _rewrite(tiny_llama_dir, tmp_path / "scaled", _with_scales)
    flags = {**FLAGS, "kv_cache_dtype": "auto"}
    scaled = LLM(str(tmp_path / "scaled"), **flags).generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=12))
    plain = LLM(str(tiny_llama_dir), **flags).generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=12))
    assert [o.token_ids for o in scaled] == [o.token_ids for o in plain]


def test_a_compressed_tensors_kv_cache_scheme_is_served(tmp_path, tiny_llama_dir):
    """llm-compressor's FP8 weights with an FP8 KV cache scheme: loaded, its scales read."""
    fp8_dir, _ = write_fp8(tiny_llama_dir, tmp_path, per_channel=True, static=False,
                           method="compressed-tensors")
    config = json.loads((fp8_dir / "config.json").read_text())
    config["quantization_config"]["kv_cache_scheme"] = {
        "num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}
    (fp8_dir / "config.json").write_text(json.dumps(config))
    state = load_file(str(fp8_dir / "model.safetensors"))
    _with_scales(state)
    save_file(state, str(fp8_dir / "model.safetensors"), metadata={"format": "pt"})
    llm = LLM(str(fp8_dir), **FLAGS)
    attention = llm.engine.runner.model.model.layers[-1].self_attn
    assert (attention.k_scale, attention.v_scale) == (K_SCALE, V_SCALE)
    assert len(llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=4))) == 3
    config["quantization_config"]["kv_cache_scheme"] = {"num_bits": 8, "type": "int",
                                                        "strategy": "tensor"}
    (fp8_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(BadInput, match=r"kv_cache_scheme .* \(FP8 per tensor, static scales only\)"):
        make_plan(EngineConfig(model=str(fp8_dir), **FLAGS))


def test_a_kv_scale_per_head_is_refused_by_name(tmp_path, tiny_llama_dir):
    def per_head(state: dict) -> None:
        _with_scales(state)
        state["model.layers.0.self_attn.k_scale"] = torch.ones(2)

    _rewrite(tiny_llama_dir, tmp_path / "per-head", per_head)
    with pytest.raises(BadInput, match=r"'model.layers.0.self_attn.k_scale' is \[2\], expected one number"):
        LLM(str(tmp_path / "per-head"), **FLAGS)
