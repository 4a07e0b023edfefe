"""IBM Granite 3.x and Phi-3/Phi-4 checkpoints, as transformers writes them, served by
kvledger's engine: greedy tokens equal transformers' ``generate`` and every position's
logits its forward pass's (float32), for a batch of two prompts of different lengths.

Granite with none of its four multipliers 1 (and Granite-MoE's experts); Phi-3 with its
fused ``qkv_proj`` and ``gate_up_proj`` split at load, Phi-4-mini's partial rotary (0.75 of
each head) and longrope on a prompt under and over ``original_max_position_embeddings``."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from _tiny_models import save_tiny

from kvledger.engine import LLM, SamplingParams
from kvledger.engine.checkpoint.model_config import ModelConfig
from kvledger.engine.cli import main
from kvledger.engine.errors import BadInput
from kvledger.engine.model.attention import AttentionMetadata, PrefillSpan

VOCAB = 1024  # the built-in tiny-llama's tokenizer, copied beside the weights
LOGITS_TOLERANCE = 1e-4  # float32 on both sides: rounding only
# Phi-4-mini's shape in small: 3/4 of each head turned, longrope from a 64-token original.
ORIGINAL = 64
LONGROPE = {"max_position_embeddings": 256, "original_max_position_embeddings": ORIGINAL,
            "partial_rotary_factor": 0.75,
            "rope_scaling": {"type": "longrope",
                             "short_factor": [1.0, 1.3, 2.1], "long_factor": [1.5, 4.0, 9.0]}}


@pytest.fixture
def tiny(tmp_path, tiny_llama_dir):
    """``save_tiny`` with the vocabulary of the tokenizer it copies in."""
    def save(name: str, **fields):
        folder = save_tiny(name, tmp_path / name, **{"vocab_size": VOCAB, **fields})
        for file in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(tiny_llama_dir / file, folder / file)
        return folder

    return save


def _prompts(lengths: tuple[int, ...], seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in lengths]


def _transformers(folder):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@torch.inference_mode()
def _engine_logits(llm: LLM, prompt: list[int]) -> torch.Tensor:
    """Every position's logits from the engine's loaded model (the whole prompt, no cache)."""
    runner = llm.engine.runner
    cos, sin = runner.rope.lookup(torch.arange(len(prompt)))
    meta = AttentionMetadata(None, [PrefillSpan(0, len(prompt), None)], [])
    return runner.model.logits(runner.model(torch.tensor(prompt), cos, sin, None, meta))


@torch.inference_mode()
def _check(folder, prompts: list[list[int]], max_tokens: int, **flags) -> float:
    """Tokens equal transformers' and logits within tolerance; the largest difference."""
    reference = _transformers(folder)
    llm = LLM(str(folder), device="cpu", dtype="float32", **flags)
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                   ignore_eos=True))
    worst = 0.0
    for prompt, out in zip(prompts, outputs, strict=True):
        ids = torch.tensor([prompt])
        expected = reference.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                      max_new_tokens=max_tokens, min_new_tokens=max_tokens)
        assert out.token_ids == expected[0, len(prompt):].tolist(), f"prompt of {len(prompt)}"
        got, want = _engine_logits(llm, prompt), reference(ids).logits[0].float()
        worst = max(worst, float((got - want).abs().max()))
    assert worst < LOGITS_TOLERANCE, f"logits differ by {worst}"
    return worst


def test_granite_multipliers_match_transformers(tiny):
    """Embeddings times 3, attention scaled by 0.25, each block's output halved before the
    residual add, logits divided by 4 (tests/_tiny_models.py): tokens and logits equal."""
    folder = tiny("granite")
    _check(folder, _prompts((9, 31), seed=1), 16, max_model_len=128)


def test_granite_with_attention_bias_and_tied_embeddings(tiny):
    """Granite 3.x ties its embeddings; ``attention_bias`` gives q, k, v and o a bias."""
    folder = tiny("granite", attention_bias=True, tie_word_embeddings=True)
    _check(folder, _prompts((5, 40), seed=2), 12, max_model_len=128)


def test_phi3_fused_projections_match_transformers(tiny):
    """qkv_proj and gate_up_proj as the checkpoint stores them, split by the loader."""
    folder = tiny("phi3")
    _check(folder, _prompts((7, 29), seed=3), 16, max_model_len=128)


def test_phi3_partial_rotary_matches_transformers(tiny):
    """``partial_rotary_factor`` 0.75: RoPE turns 6 of each head's 8 dimensions."""
    folder = tiny("phi3", partial_rotary_factor=0.75)
    assert ModelConfig.from_dir(folder).rotary_dim == 6
    _check(folder, _prompts((11, 37), seed=4), 16, max_model_len=128)


def test_phi3_longrope_under_the_original_length_turns_by_the_short_factors(tiny):
    """A run within ``original_max_position_embeddings`` (64): the short factors, as
    transformers uses them for a sequence that stays under it."""
    folder = tiny("phi3", **LONGROPE)
    _check(folder, _prompts((12, 30), seed=5), 20, max_model_len=ORIGINAL)


def test_phi3_longrope_past_the_original_length_turns_by_the_long_factors(tiny):
    """Prompts past 64 tokens in a 256-token run: the long factors and the attention
    factor sqrt(1 + ln 4 / ln 64), as transformers turns a sequence past the original
    length."""
    folder = tiny("phi3", **LONGROPE)
    config = ModelConfig.from_dir(folder)
    assert config.rope_scaling["attention_factor"] == pytest.approx(
        (1 + torch.log(torch.tensor(4.0)).item() / torch.log(torch.tensor(64.0)).item()) ** 0.5)
    _check(folder, _prompts((70, 100), seed=6), 20, max_model_len=256)


def test_phi3_plan_counts_the_context_and_the_weights(tmp_path, capsys):
    """``kvledger plan``: a longrope model runs original_max_position_embeddings unless
    asked more (vLLM 0.32's default, the short factors), at most max_position_embeddings
    (not times a factor); the weights the fused tensors' bytes as stored."""
    folder = save_tiny("phi3", tmp_path / "phi3", **LONGROPE)
    assert main(["plan", str(folder), "--device", "cpu", "--json", "--max-model-len",
                 "256"]) == 0
    assert json.loads(capsys.readouterr().out)["max_model_len"] == 256
    assert main(["plan", str(folder), "--device", "cpu", "--max-model-len", "257"]) == 2
    capsys.readouterr()
    assert main(["plan", str(folder), "--device", "cpu", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["max_model_len"] == ORIGINAL
    stored = (folder / "model.safetensors").stat().st_size
    header = 8 + int.from_bytes((folder / "model.safetensors").read_bytes()[:8], "little")
    assert plan["classes"]["weights"] == stored - header


@pytest.mark.parametrize(("change", "says"), [
    ({"quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic"}},
     "quantized Phi3ForCausalLM"),
    ({"rope_parameters": {"rope_type": "longrope", "short_factor": [1.0],
                          "long_factor": [1.0, 1.0, 1.0, 1.0]}},
     "short_factor must list 4"),
    ({"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.1}},
     "RoPE needs an even number"),
])
def test_phi3_configs_the_engine_cannot_run_are_refused_in_one_line(tmp_path, change, says):
    raw = json.loads((save_tiny("phi3", tmp_path / "phi3") / "config.json").read_text())
    with pytest.raises(BadInput, match=says) as refused:
        ModelConfig.from_dict({**raw, **change})
    assert "\n" not in str(refused.value)


def test_a_quantized_granite_moe_is_refused(tmp_path):
    raw = json.loads((save_tiny("granitemoe", tmp_path / "g") / "config.json").read_text())
    quantized = {**raw, "quantization_config": {"quant_method": "fp8",
                                                "activation_scheme": "dynamic"}}
    with pytest.raises(BadInput, match="quantized GraniteMoeForCausalLM checkpoint"):
        ModelConfig.from_dict(quantized)


def test_granite_multiplier_of_zero_is_refused(tmp_path):
    raw = json.loads((save_tiny("granite", tmp_path / "g") / "config.json").read_text())
    with pytest.raises(BadInput, match="'logits_scaling' must be a positive number"):
        ModelConfig.from_dict({**raw, "logits_scaling": 0})


def test_a_phi3_adapter_on_the_fused_projections_is_refused_naming_the_module(tmp_path):
    """PEFT's Phi-3 adapters target qkv_proj and gate_up_proj, the fused layers the engine
    splits: refused by name (exit 2 / 400), never loaded onto the wrong rows."""
    from kvledger.engine.planner.adapters import read_adapter_files

    folder = save_tiny("phi3", tmp_path / "phi3")
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps(
        {"r": 4, "lora_alpha": 8, "target_modules": ["qkv_proj", "o_proj"]}))
    (adapter / "adapter_model.safetensors").write_bytes(b"")
    with pytest.raises(BadInput, match="target module 'qkv_proj'"):
        read_adapter_files("LoRA adapter 'a'", adapter, ModelConfig.from_dir(folder), 16)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("name", "fields"), [("granite", {}), ("granitemoe", {}),
                                              ("phi3", LONGROPE)])
def test_two_tensor_parallel_ranks_give_transformers_tokens(tiny, name, fields):
    """--tensor-parallel-size 2: Granite's multipliers around the all-reduced blocks; Phi-3's
    fused tensors split per head group before each rank takes its heads (a fused tensor
    cut in two equal row ranges would hand rank 0 all of q and rank 1 k and v)."""
    folder = tiny(name, **fields)
    prompts = _prompts((66, 90), seed=8)  # past the original length: long factors, as transformers
    llm = LLM(str(folder), device="cpu", dtype="float32", max_model_len=256,
              tensor_parallel_size=2)
    try:
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10,
                                                       ignore_eos=True))
        assert llm.engine.runner.config.num_attention_heads == 2  # rank 0's shard
    finally:
        llm.engine.runner.ranks.stop()
    reference = _transformers(folder)
    for prompt, out in zip(prompts, outputs, strict=True):
        ids = torch.tensor([prompt])
        expected = reference.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                      max_new_tokens=10, min_new_tokens=10)
        assert out.token_ids == expected[0, len(prompt):].tolist(), f"prompt of {len(prompt)}"


def test_granite_moe_matches_transformers(tiny):
    """Granite-MoE: the multipliers, and 4 experts stored as input_linear/output_linear
    (split per expert at load), the router's softmax over the top 2 logits."""
    folder = tiny("granitemoe")
    assert ModelConfig.from_dir(folder).moe.num_experts == 4
    _check(folder, _prompts((8, 33), seed=9), 16, max_model_len=128)
