"""4-bit weights in the engine (engine/model/int4_linear.py): GPTQ (sym true and false,
desc_act via g_idx, group_size -1, v1 zeros), AWQ (GEMM packing, its nibble order) and
compressed-tensors W4A16 (pack-quantized, group and channel, with and without zero
points). The checkpoints are written by tests/_int4_checkpoints.py from integer codes
the helper chooses; the reference is transformers on ``(code - zero) * scale`` from those
same integers, never unpacked. The engine keeps the packed tensors as stored, the plan
counts exactly those bytes, and its greedy tokens equal the reference's (CPU, float32)."""

from __future__ import annotations

import random

import pytest
import torch
from _engine_helpers import hf_greedy
from _int4_checkpoints import pack, quantize_layer, write_int4

from kvledger.engine import LLM, SamplingParams
from kvledger.engine.model.int4_linear import Int4Linear, unpack_nibbles
from kvledger.engine.model.loader import weights_bytes
from kvledger.engine.planner.plan import make_plan
from kvledger.engine.settings.config import EngineConfig

FLAGS = {"max_model_len": 128, "max_num_seqs": 3, "device": "cpu", "dtype": "float32"}


def _prompts(vocab_size: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, vocab_size) for _ in range(n)] for n in (1, 5, 17, 40, 70)]


@pytest.mark.parametrize("name, method, sym, group_size, desc_act", [
    ("tiny-llama", "gptq", True, 32, False),
    ("tiny-llama", "gptq", False, 32, True),          # act-order: g_idx permuted
    ("tiny-qwen2", "gptq", False, -1, False),         # one group; q/k/v biases
    ("tiny-llama", "awq", False, 32, False),
    ("tiny-mixtral", "awq", False, 32, False),        # experts quantized, the router not
    ("tiny-llama", "compressed-tensors", True, 32, False),
    ("tiny-qwen2", "compressed-tensors", False, 32, False),   # packed zero points
    ("tiny-llama", "compressed-tensors", True, -1, False),    # channel strategy
])
def test_int4_checkpoint_matches_transformers_dequantized(tmp_path, make_model_dir, name, method,
                                                          sym, group_size, desc_act):
    q_dir, reference = write_int4(make_model_dir(name), tmp_path, method, sym=sym,
                                  group_size=group_size, desc_act=desc_act)
    llm = LLM(str(q_dir), **FLAGS)
    model = llm.engine.runner.model
    layers = [m for m in model.modules() if isinstance(m, Int4Linear)]
    config = model.config
    per_layer = 4 + (3 if config.moe is None else 3 * config.moe.num_experts)
    assert len(layers) == config.num_layers * per_layer
    assert not isinstance(model.lm_head, Int4Linear)
    held = weights_bytes(model)
    planned = make_plan(EngineConfig(model=str(q_dir), **FLAGS)).classes["weights"]
    assert held == planned
    assert held < 0.6 * make_plan(EngineConfig(model=str(reference), **FLAGS)).classes["weights"]
    prompts = _prompts(config.vocab_size, seed=len(name) + group_size)
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16))
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.token_ids == hf_greedy(str(reference), prompt, 16), f"prompt of {len(prompt)}"


@pytest.mark.parametrize("method, sym, desc_act", [
    ("gptq", True, False), ("gptq", False, True), ("awq", False, False),
    ("compressed-tensors", True, False), ("compressed-tensors", False, False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_layer_dequantizes_its_stored_tensors_exactly(method, sym, desc_act, dtype):
    """The round trip: the helper's packing of chosen codes, read back by the engine's
    layer, is ``(code - zero) * scale`` exactly (in float32; in bfloat16 to its rounding)."""
    weight = torch.randn(48, 64, generator=torch.Generator().manual_seed(0))
    stored, expected = quantize_layer(weight, method, sym=sym, group_size=16,
                                      desc_act=desc_act, seed=1)
    fmt = {"compressed-tensors": "w4a16"}.get(method, method)
    groups = 4
    layer = Int4Linear(fmt, "layer", 64, 48, groups, scale_dtype=torch.float16,
                       zeros="weight_zero_point" in stored, g_idx="g_idx" in stored, bias=False)
    layer.load_state_dict(stored, assign=True)
    got = layer.dequantized(dtype)
    if dtype == torch.float32:
        assert torch.equal(got, expected)
    else:
        assert torch.allclose(got.float(), expected, rtol=2**-7, atol=0)


def test_nibble_orders_are_the_published_ones():
    """Pinned by hand, not by the helper: codes 0..7 packed along the input (GPTQ, W4A16)
    are the word 0x76543210; along AWQ's outputs, in its order, 0x75316420."""
    word = torch.tensor([[0x76543210]], dtype=torch.int32)
    assert unpack_nibbles(word, 1).tolist() == [[0, 1, 2, 3, 4, 5, 6, 7]]
    assert unpack_nibbles(word, 0).flatten().tolist() == [0, 1, 2, 3, 4, 5, 6, 7]
    assert pack(torch.arange(8).view(1, 8), 1, (0, 2, 4, 6, 1, 3, 5, 7)).item() == 0x75316420
    # An AWQ layer of one input and outputs 0..7 reading that word dequantizes to 0..7.
    layer = Int4Linear("awq", "layer", 8, 8, 1, scale_dtype=torch.float16, zeros=True, g_idx=False,
                       bias=False)
    codes = torch.zeros(8, 8, dtype=torch.long)
    codes[0] = torch.arange(8)
    layer.load_state_dict({"qweight": pack(codes, 1, (0, 2, 4, 6, 1, 3, 5, 7)),
                           "qzeros": torch.zeros(1, 1, dtype=torch.int32),
                           "scales": torch.ones(1, 8, dtype=torch.float16)}, assign=True)
    assert layer.dequantized(torch.float32)[:, 0].tolist() == list(range(8))


def test_gptq_v1_zeros_read_plus_one_as_vllm_reads_them():
    """A stored zero of 15 (a true zero of 0 stored as -1) reads as 16: the v1 format's
    convention, kept rather than guessed around."""
    layer = Int4Linear("gptq", "layer", 8, 8, 1, scale_dtype=torch.float16, zeros=True, g_idx=False,
                       bias=False)
    layer.load_state_dict({"qweight": torch.zeros(1, 8, dtype=torch.int32),
                           "qzeros": torch.full((1, 1), -1, dtype=torch.int32),  # all 0xF
                           "scales": torch.ones(1, 8, dtype=torch.float16)}, assign=True)
    assert torch.equal(layer.dequantized(torch.float32), torch.full((8, 8), -16.0))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_plan_counts_what_the_engine_holds_when_the_rest_is_cast(tmp_path, tiny_llama_dir,
                                                                     dtype):
    """A 4-bit checkpoint as published: float16 embeddings, norms and LM head, float16
    scales. The engine casts the floats to ``--dtype`` and keeps the packed layers as
    stored; the plan's weights are those bytes exactly."""
    from safetensors.torch import load_file, save_file

    q_dir, _ = write_int4(tiny_llama_dir, tmp_path, "gptq", desc_act=True)
    path = str(q_dir / "model.safetensors")
    state = {name: t.half() if t.is_floating_point() and not name.endswith(".scales") else t
             for name, t in load_file(path).items()}
    save_file(state, path, metadata={"format": "pt"})
    flags = {**FLAGS, "dtype": dtype}
    llm = LLM(str(q_dir), **flags)
    held = weights_bytes(llm.engine.runner.model)
    assert held == make_plan(EngineConfig(model=str(q_dir), **flags)).classes["weights"]
    packed = sum(t.numel() * t.element_size() for n, t in state.items()
                 if n.rsplit(".", 1)[-1] in ("qweight", "qzeros", "scales", "g_idx"))
    rest = sum(t.numel() for n, t in state.items() if n.endswith(".weight"))
    assert held == packed + rest * (4 if dtype == "float32" else 2)
