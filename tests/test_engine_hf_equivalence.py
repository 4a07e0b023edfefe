"""Greedy tokens equal Hugging Face transformers' on the same checkpoint, with many
prompts of different lengths running concurrently (batching must not change a token).

Both run on the CPU, or on ``KVLEDGER_TEST_DEVICE`` (``cuda``: bench/gpu_checks.sh), in
float32 (the built-in checkpoints' dtype)."""

from __future__ import annotations

import os
import random

import pytest
import torch
import transformers  # a declared test dependency: missing, these tests must fail, not skip

from kvledger.engine import LLM, SamplingParams

DEVICE = os.environ.get("KVLEDGER_TEST_DEVICE", "cpu")


def _prompts(vocab_size: int, count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [1, 2, 7, 16, 17, 33, 50, 80] + [rng.randint(3, 90) for _ in range(count - 8)]
    return [[rng.randrange(2, vocab_size) for _ in range(n)] for n in lengths]


def _hf_greedy(model_dir, prompt: list[int], max_new_tokens: int) -> list[int]:
    model = _hf_greedy.models.get(model_dir)
    if model is None:
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        _hf_greedy.models[model_dir] = model = model.to(DEVICE).eval()
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt], device=DEVICE),
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=DEVICE),
                             max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(prompt):].tolist()


_hf_greedy.models = {}


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-mistral", "tiny-qwen2"])
def test_greedy_tokens_equal_transformers_with_concurrent_batching(make_model_dir, name):
    model_dir = make_model_dir(name)
    # Fewer sequences than prompts: requests join and leave the batch between steps.
    llm = LLM(str(model_dir), max_model_len=256, max_num_seqs=5, device=DEVICE)
    prompts = _prompts(llm.engine.runner.config.vocab_size, 12, seed=len(name))
    max_tokens = [40 - 3 * i for i in range(len(prompts))]
    params = [SamplingParams(temperature=0, max_tokens=n) for n in max_tokens]
    outputs = llm.generate(prompts, params)
    for prompt, n, out in zip(prompts, max_tokens, outputs, strict=True):
        expected = _hf_greedy(str(model_dir), prompt, n)
        assert out.token_ids == expected, f"prompt of {len(prompt)} tokens"
        assert out.finish_reason == ("length" if len(expected) == n else "stop")


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-mistral"])
def test_chunked_prefill_tokens_equal_transformers(make_model_dir, name):
    """Prompts longer than the step budget are computed in chunks that attend to the
    cache of earlier chunks (and, for Mistral, across the sliding window)."""
    model_dir = make_model_dir(name)
    llm = LLM(str(model_dir), max_model_len=256, max_num_seqs=4, max_num_batched_tokens=24,
              device=DEVICE)
    prompts = [p for p in _prompts(llm.engine.runner.config.vocab_size, 12, seed=7) if len(p) > 24]
    assert len(prompts) >= 4
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=30))
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.token_ids == _hf_greedy(str(model_dir), prompt, 30), f"prompt of {len(prompt)}"


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

    llm = LLM(str(model_dir), max_model_len=128, max_num_seqs=3, device=DEVICE)
    prompts = _prompts(config["vocab_size"], 8, seed=5)
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12))
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.token_ids == _hf_greedy(str(model_dir), prompt, 12)
