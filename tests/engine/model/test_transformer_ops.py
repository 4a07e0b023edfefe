"""The step's small operations, rewritten with fewer ops, give Hugging Face's figures: the
rotary embedding as one ``roll`` against a sign-carrying sin table, RMSNorm as torch's
fused op in float32, and each decode group's mask built once a step as the additive mask
every layer's attention would otherwise make of a boolean one. (Whole models against
transformers: test_hf_equivalence.py.)"""

from __future__ import annotations

import pytest
import torch

from kvledger.engine.checkpoint.model_config import ModelConfig
from kvledger.engine.core.runner import ModelRunner
from kvledger.engine.model.builtin import MODELS
from kvledger.engine.model.transformer import CausalLM, RMSNorm, RotaryEmbedding, _rope


def _rotate_half(x: torch.Tensor) -> torch.Tensor:  # Hugging Face's
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _config() -> ModelConfig:
    return ModelConfig.from_dict({**MODELS["tiny-llama"], "vocab_size": 64})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_equals_the_rotate_half_formula_figure_for_figure(dtype):
    config = _config()
    rope = RotaryEmbedding(config, 64, torch.device("cpu"), dtype)
    positions = torch.tensor([0, 1, 5, 63, 17])
    cos, sin = rope.lookup(positions)
    x = torch.randn(5, 3, config.head_dim, generator=torch.Generator().manual_seed(0)).to(dtype)
    # Hugging Face's table: the same sines, the first half not negated.
    half = config.head_dim // 2
    hf_sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
    expected = x * cos[:, None] + _rotate_half(x) * hf_sin[:, None]
    assert torch.equal(_rope(x, cos[:, None], sin[:, None]), expected)


def test_rmsnorm_in_float32_matches_the_written_out_formula():
    norm = RMSNorm(64, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 1.5, 64))
    x = torch.randn(7, 64, generator=torch.Generator().manual_seed(1)) * 3
    expected = norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
    torch.testing.assert_close(norm(x), expected, rtol=1e-6, atol=1e-6)
    half = x.to(torch.bfloat16)  # other dtypes keep computing in float32, then cast back
    written = half.float()
    written = norm.weight * (written * torch.rsqrt(written.pow(2).mean(-1, keepdim=True) + 1e-5)
                             ).to(torch.bfloat16)
    assert torch.equal(norm(half), written)


def test_a_decode_groups_mask_is_additive_over_each_rows_context():
    runner = ModelRunner(CausalLM(_config()), torch.device("cpu"), 64, 4)
    group = runner.attention.decode_group([[3, 1], [0, 2, 5]], [5, 9])
    mask = group.mask[:, 0, 0]
    assert mask.dtype == runner.dtype and mask.shape == (2, 12)
    attend = torch.arange(12)[None, :] < torch.tensor([5, 9])[:, None]
    assert torch.equal(mask == 0, attend) and bool(torch.isneginf(mask[~attend]).all())


def test_decode_attention_takes_an_output_laid_out_heads_and_rows_transposed(
        tiny_llama_dir, monkeypatch):
    """CUDA's memory-efficient kernel (float32 with a mask) returns ``[seqs, kv_heads,
    rows, head_dim]`` as a transposed view of ``[seqs, rows, kv_heads, head_dim]``; the
    engine must take that layout (tiny-llama: 2 K/V heads of 2 query heads each) and
    decode the same tokens."""
    from kvledger.engine import LLM, SamplingParams
    from kvledger.engine.model import transformer

    def greedy() -> list[list[int]]:
        llm = LLM(str(tiny_llama_dir), max_model_len=128, max_num_seqs=3, device="cpu")
        params = SamplingParams(temperature=0, max_tokens=12)
        return [o.token_ids for o in llm.generate([[5, 6, 7], [9] * 20, [11, 12]], params)]

    expected = greedy()
    sdpa = transformer.F.scaled_dot_product_attention
    laid_out = []

    def efficient_layout(*args, **kwargs):
        o = sdpa(*args, **kwargs)
        laid_out.append(o.shape)
        return o.transpose(1, 2).contiguous().transpose(1, 2)

    monkeypatch.setattr(transformer.F, "scaled_dot_product_attention", efficient_layout)
    assert greedy() == expected
    assert any(shape[2] == 2 and shape[1] == 2 for shape in laid_out)  # decode groups ran
