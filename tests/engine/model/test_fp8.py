"""FP8 weights in the engine (engine/model/fp8_linear.py): checkpoints quantized with
``quant_method: fp8`` or compressed-tensors' float-quantized FP8, and ``--quantization
fp8`` on load. The weights stay float8_e4m3fn in memory, the plan counts exactly the bytes
the engine holds, and greedy tokens equal transformers' on the same weights dequantized
to float32 (CPU, ``--dtype float32``).

What is compared, honestly: with dynamic activations the engine multiplies the inputs as
they are by the dequantized weights, so the reference is transformers on the dequantized
checkpoint, unchanged. With a static ``input_scale`` the engine rounds each quantized
layer's input to e4m3 first (as vLLM does); the reference is transformers on the
dequantized checkpoint with the same rounding applied to the same layers' inputs (forward
pre-hooks), and a test checks the rounding changes the logits, so it is not vacuous."""

from __future__ import annotations

import random

import pytest
import torch
from _engine_helpers import hf_greedy
from _fp8_checkpoints import STATIC_INPUT_SCALE, write_fp8

from kvledger.engine import LLM, SamplingParams
from kvledger.engine.checkpoint.fp8_format import quantized_linear
from kvledger.engine.model.fp8_linear import Fp8Linear, quantize
from kvledger.engine.model.loader import weights_bytes
from kvledger.engine.planner.plan import make_plan
from kvledger.engine.settings.config import EngineConfig

FLAGS = {"max_model_len": 128, "max_num_seqs": 3, "device": "cpu", "dtype": "float32"}


def _prompts(vocab_size: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, vocab_size) for _ in range(n)] for n in (1, 5, 17, 40, 70)]


def _fp8_layers(llm: LLM) -> list[Fp8Linear]:
    return [m for m in llm.engine.runner.model.modules() if isinstance(m, Fp8Linear)]


def _planned_weights(model_dir, **flags) -> int:
    config = EngineConfig(model=str(model_dir), **{**FLAGS, **flags})
    return make_plan(config).classes["weights"]


def _static_reference(model_dir, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy tokens with each quantized layer's input rounded to e4m3 by
    the static input scale, as the engine rounds it."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    scale = torch.tensor(STATIC_INPUT_SCALE)

    def round_input(_module, args):
        return (quantize(args[0], scale).float() * scale,)

    for name, module in model.named_modules():
        if quantized_linear(name + ".weight"):
            module.register_forward_pre_hook(round_input)
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt),
                             dtype=torch.long), max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("name, method, per_channel", [
    ("tiny-llama", "fp8", False),
    ("tiny-qwen2", "compressed-tensors", True),     # q/k/v biases beside FP8 weights
    ("tiny-mixtral", "fp8", True),                  # experts quantized, the router not
])
def test_dynamic_fp8_checkpoint_matches_transformers_dequantized(tmp_path, make_model_dir,
                                                                 name, method, per_channel):
    fp8_dir, reference = write_fp8(make_model_dir(name), tmp_path, per_channel=per_channel,
                                   static=False, method=method)
    llm = LLM(str(fp8_dir), **FLAGS)
    layers = _fp8_layers(llm)
    assert layers and all(layer.weight.dtype == torch.float8_e4m3fn for layer in layers)
    assert all(layer.input_scale is None for layer in layers)
    model = llm.engine.runner.model
    assert not isinstance(model.lm_head, Fp8Linear)  # the LM head is not quantized
    assert weights_bytes(model) == _planned_weights(fp8_dir)
    prompts = _prompts(model.config.vocab_size, seed=len(name))
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16))
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.token_ids == hf_greedy(str(reference), prompt, 16), f"prompt of {len(prompt)}"


def test_static_input_scales_round_the_inputs_as_the_reference_does(tmp_path, tiny_llama_dir):
    fp8_dir, reference = write_fp8(tiny_llama_dir, tmp_path, per_channel=True, static=True)
    llm = LLM(str(fp8_dir), **FLAGS)
    layers = _fp8_layers(llm)
    assert len(layers) == 7 * 4 and all(layer.input_scale is not None for layer in layers)
    assert weights_bytes(llm.engine.runner.model) == _planned_weights(fp8_dir)
    prompts = _prompts(1024, seed=3)
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16))
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.token_ids == _static_reference(str(reference), prompt, 16)
    # The rounding is there: the same layer without it gives other outputs.
    layer, x = layers[0], torch.randn(4, layers[0].in_features)
    rounded = layer(x)
    layer.input_scale = None
    assert not torch.allclose(rounded, layer(x), rtol=0, atol=1e-4)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2", "tiny-mixtral"])
def test_quantization_fp8_on_load_is_planned_exactly_and_matches_its_dequantized_weights(
        tmp_path, make_model_dir, name):
    """``--quantization fp8``: every linear layer of a float32 checkpoint in FP8, one scale
    per output channel; the plan's weights are the bytes the engine holds (against about
    4x that unquantized), and its tokens are transformers' on the dequantized weights."""
    from safetensors.torch import load_file, save_file

    source = make_model_dir(name)
    llm = LLM(str(source), quantization="fp8", **FLAGS)
    model = llm.engine.runner.model
    layers = _fp8_layers(llm)
    assert layers and all(layer.weight_scale.shape == (layer.out_features, 1) for layer in layers)
    held = weights_bytes(model)
    assert held == _planned_weights(source, quantization="fp8")
    assert held < 0.8 * _planned_weights(source)
    # The reference: the checkpoint with each quantized weight replaced by the engine's
    # FP8 weight times its scale, everything else as stored.
    reference = tmp_path / "dequantized"
    reference.mkdir()
    for path in source.iterdir():
        if path.name != "model.safetensors":
            (reference / path.name).write_bytes(path.read_bytes())
    state = load_file(str(source / "model.safetensors"))
    for prefix, module in model.named_modules():
        if isinstance(module, Fp8Linear):
            state[prefix + ".weight"] = module.weight.float() * module.weight_scale
    save_file(state, str(reference / "model.safetensors"), metadata={"format": "pt"})
    prompts = _prompts(model.config.vocab_size, seed=11)
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16))
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.token_ids == hf_greedy(str(reference), prompt, 16), f"prompt of {len(prompt)}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dequantize_equals_torchs_float8_cast_for_every_finite_value(dtype):
    """The bit shift into float16 (fp8_linear.dequantize) against torch's own cast, on all
    254 finite e4m3fn values (subnormals and both zeros included), times a scale."""
    from kvledger.engine.model.fp8_linear import dequantize

    values = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    finite = values[~values.float().isnan()].view(-1, 1)
    assert finite.numel() == 254
    for scale in (torch.tensor(1.0), torch.tensor(3.7e-3), torch.rand(254, 1) + 0.01):
        expected = finite.to(dtype) * scale.to(dtype)
        assert torch.equal(dequantize(finite, scale, dtype), expected)
