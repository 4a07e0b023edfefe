"""Fused projections (engine/model/fusion.py): q/k/v and gate/up as one layer each compute
what the separate layers computed, hold the same bytes, and stay apart with LoRA and for
layers that are not plain nn.Linear."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from _engine_helpers import make_engine
from torch import nn

from kvledger.engine.checkpoint.model_config import ModelConfig
from kvledger.engine.model.builtin import MODELS
from kvledger.engine.model.cpu_linear import PackedLinear, pack_linears, packable
from kvledger.engine.model.fusion import fuse_projections
from kvledger.engine.model.loader import weights_bytes
from kvledger.engine.model.transformer import MLP, Attention


def _config(qkv_bias: bool) -> ModelConfig:
    config = ModelConfig.from_dict({**MODELS["tiny-llama"], "vocab_size": 64})
    return dataclasses.replace(config, qkv_bias=qkv_bias)


def _random(module: nn.Module, dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    for p in module.parameters():
        p.data.normal_(0, 0.1)
    return module.to(dtype).requires_grad_(False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qkv_bias", [False, True])
@pytest.mark.parametrize("packed", [False, True])
def test_fused_projections_compute_what_the_parts_computed(dtype, qkv_bias, packed):
    config = _config(qkv_bias)
    attn = _random(Attention(config), dtype)
    mlp = _random(MLP(config.hidden_size, config.intermediate_size), dtype)
    x = torch.randn(5, config.hidden_size, dtype=dtype)
    want = {"q": attn.q_proj(x), "k": attn.k_proj(x), "v": attn.v_proj(x),
            "gate": mlp.gate_proj(x), "up": mlp.up_proj(x)}
    before = weights_bytes(attn) + weights_bytes(mlp)
    holder = nn.ModuleDict({"attn": attn, "mlp": mlp})
    assert fuse_projections(holder) == 2
    if packed:
        # qkv, o, gate_up, down; none for bfloat16 on a CPU without AVX-512
        assert pack_linears(holder, torch.device("cpu")) == 4 * packable(dtype)
        assert isinstance(attn.qkv_proj, PackedLinear) == packable(dtype)
    assert not hasattr(attn, "q_proj") and not hasattr(mlp, "up_proj")  # the parts are gone
    assert weights_bytes(attn) + weights_bytes(mlp) == before  # held once
    q, k, v = attn.qkv_proj(x).split(attn.fused_sizes, dim=-1)
    gate, up = mlp.gate_up_proj(x).split(mlp.fused_sizes, dim=-1)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    for name, got in {"q": q, "k": k, "v": v, "gate": gate, "up": up}.items():
        assert got.shape == want[name].shape
        diff = (got.float() - want[name].float()).abs().max()
        assert diff <= tolerance * want[name].float().abs().max(), name


def test_the_model_forward_is_the_same_fused(make_model_dir):
    prompts = [[5, 9, 11, 40, 3, 7], [100, 2, 64]]

    def greedy(engine):
        from _engine_helpers import drain

        from kvledger.engine.sampling.params import SamplingParams

        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{i}", prompt, params)
        return drain(engine)

    model_dir = make_model_dir("tiny-llama")
    fused_engine = make_engine(model_dir)
    apart_engine = make_engine(model_dir, enable_lora=True)  # LoRA keeps the parts
    attn = fused_engine.runner.model.model.layers[0].self_attn
    assert attn.qkv_proj is not None and not hasattr(attn, "q_proj")
    lora_attn = apart_engine.runner.model.model.layers[0].self_attn
    assert lora_attn.qkv_proj is None and hasattr(lora_attn, "q_proj")
    fused, apart = greedy(fused_engine), greedy(apart_engine)
    for rid, out in fused.items():
        assert out.token_ids == apart[rid].token_ids
        for a, b in zip(out.logprobs, apart[rid].logprobs, strict=True):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)


def test_layers_that_are_not_plain_linear_stay_apart():
    config = _config(False)
    attn = Attention(config)
    attn.k_proj = nn.Identity()  # as an fp8 or int4 layer would be: not nn.Linear
    mlp = MLP(config.hidden_size, config.intermediate_size)
    mlp.up_proj = mlp.up_proj.to(torch.bfloat16)  # mixed dtypes do not fuse
    assert fuse_projections(nn.ModuleDict({"attn": attn, "mlp": mlp})) == 0
    assert attn.qkv_proj is None and mlp.gate_up_proj is None
    assert isinstance(attn.q_proj, nn.Linear) and isinstance(mlp.gate_proj, nn.Linear)
