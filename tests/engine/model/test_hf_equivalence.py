"""Greedy tokens equal Hugging Face transformers' on the same checkpoint, with many
prompts of different lengths running concurrently (batching must not change a token),
for every architecture the engine runs: dense (Llama, Mistral, Qwen2, Qwen3) and
mixture-of-experts (Mixtral, Qwen3-MoE), whose routing depends on the batch's tokens.

Both run on the CPU, or on ``KVLEDGER_TEST_DEVICE`` (``cuda``: bench/gpu_checks.sh), in
float32 (the built-in checkpoints' dtype), asked for: ``--dtype auto`` would serve them in
bfloat16 on a GPU."""

from __future__ import annotations

import random

import pytest
import torch
from _engine_helpers import DEVICE, hf_greedy

from kvledger.engine import LLM, SamplingParams


def _llm(model_dir, **kwargs) -> LLM:
    """The engine on ``DEVICE``, in float32 as transformers runs (auto: bf16 on a GPU)."""
    return LLM(str(model_dir), dtype="float32", device=DEVICE, **kwargs)


def _prompts(vocab_size: int, count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [1, 2, 7, 16, 17, 33, 50, 80] + [rng.randint(3, 90) for _ in range(count - 8)]
    return [[rng.randrange(2, vocab_size) for _ in range(n)] for n in lengths]


ALL_SHAPES = ["tiny-llama", "tiny-mistral", "tiny-qwen2", "tiny-qwen3", "tiny-mixtral",
              "tiny-qwen3-moe"]


@pytest.mark.parametrize("name", ALL_SHAPES)
def test_greedy_tokens_equal_transformers_with_concurrent_batching(make_model_dir, name):
    model_dir = make_model_dir(name)
    # Fewer sequences than prompts: requests join and leave the batch between steps.
    llm = _llm(model_dir, max_model_len=256, max_num_seqs=5)
    prompts = _prompts(llm.engine.runner.config.vocab_size, 12, seed=len(name))
    max_tokens = [40 - 3 * i for i in range(len(prompts))]
    params = [SamplingParams(temperature=0, max_tokens=n) for n in max_tokens]
    outputs = llm.generate(prompts, params)
    for prompt, n, out in zip(prompts, max_tokens, outputs, strict=True):
        expected = hf_greedy(str(model_dir), prompt, n)
        assert out.token_ids == expected, f"prompt of {len(prompt)} tokens"
        assert out.finish_reason == ("length" if len(expected) == n else "stop")


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-mistral", "tiny-qwen3", "tiny-mixtral",
                                  "tiny-qwen3-moe"])
def test_chunked_prefill_tokens_equal_transformers(make_model_dir, name):
    """Prompts longer than the step budget are computed in chunks that attend to the
    cache of earlier chunks (and, for Mistral, across the sliding window); a chunk's
    tokens are routed to experts alongside other prompts' chunks and decodes."""
    model_dir = make_model_dir(name)
    llm = _llm(model_dir, max_model_len=256, max_num_seqs=4, max_num_batched_tokens=24)
    prompts = [p for p in _prompts(llm.engine.runner.config.vocab_size, 12, seed=7) if len(p) > 24]
    assert len(prompts) >= 4
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=30))
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.token_ids == hf_greedy(str(model_dir), prompt, 30), f"prompt of {len(prompt)}"


def test_sliding_window_is_exercised(make_model_dir):
    """tiny-mistral's window (64) is shorter than the equality test's longest sequences."""
    import json

    config = json.loads((make_model_dir("tiny-mistral") / "config.json").read_text())
    assert config["sliding_window"] == 64 and max(len(p) for p in _prompts(1024, 12, 12)) + 40 > 64


def test_llama_with_attention_bias_and_tied_embeddings_matches(tmp_path, tiny_llama_dir):
    """Llama's ``attention_bias`` (q/k/v and o) and ``tie_word_embeddings`` variants."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    model_dir = tmp_path / "llama-bias-tied"
    shutil.copytree(tiny_llama_dir, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config.update(attention_bias=True, tie_word_embeddings=True)
    (model_dir / "config.json").write_text(json.dumps(config))
    tensors = load_file(str(model_dir / "model.safetensors"))
    gen = torch.Generator().manual_seed(3)
    tensors["model.embed_tokens.weight"] = tensors.pop("lm_head.weight")  # a small-scale table
    for name in [n for n in tensors if n.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight",
                                                    "o_proj.weight"))]:
        rows = tensors[name].shape[0]
        tensors[name.replace(".weight", ".bias")] = torch.randn(rows, generator=gen) * 0.2
    save_file(tensors, str(model_dir / "model.safetensors"), metadata={"format": "pt"})

    llm = _llm(model_dir, max_model_len=128, max_num_seqs=3)
    prompts = _prompts(config["vocab_size"], 8, seed=5)
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12))
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.token_ids == hf_greedy(str(model_dir), prompt, 12)


@pytest.mark.parametrize("name, change", [
    # Qwen3 with q/k/v/o bias, every layer sliding (max_window_layers 0) with a window of 24.
    ("tiny-qwen3", {"attention_bias": True, "use_sliding_window": True, "sliding_window": 24,
                    "max_window_layers": 0}),
    # Qwen3-MoE: top-k weights not renormalised, experts every 2nd layer, bias, a window.
    ("tiny-qwen3-moe", {"norm_topk_prob": False, "decoder_sparse_step": 2, "mlp_only_layers": [],
                        "attention_bias": True, "use_sliding_window": True, "sliding_window": 24}),
])
def test_qwen3_variants_match(tmp_path, monkeypatch, name, change):
    """The config switches the built-in Qwen3 shapes leave at their defaults."""
    from kvledger.engine.model import builtin as make_model

    config = {**make_model.MODELS[name], **change}
    monkeypatch.setitem(make_model.MODELS, name, config)
    model_dir = make_model.write_model(name, tmp_path / name)
    llm = _llm(model_dir, max_model_len=128, max_num_seqs=3, max_num_batched_tokens=32)
    if "decoder_sparse_step" in change:  # experts in layer 1 only, as transformers builds it
        assert [type(layer.mlp).__name__ for layer in llm.engine.runner.model.model.layers] == \
            ["MLP", "SparseMoE", "MLP"]
    prompts = _prompts(1024, 8, seed=9)
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12))
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.token_ids == hf_greedy(str(model_dir), prompt, 12), f"prompt of {len(prompt)}"
