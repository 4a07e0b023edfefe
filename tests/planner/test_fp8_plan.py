"""FP8 in the plan: a ``quant_method: fp8`` (or compressed-tensors float-quantized)
checkpoint is planned, not refused, at its stored size (one byte a weight, float32
scales, the rest at the model dtype); ``--quantization fp8`` is planned at the size it
quantizes to; FP8 variants the engine does not serve are refused by name. That the
engine holds exactly the planned bytes: tests/engine/model/test_fp8.py."""

from __future__ import annotations

import pytest
from budget_checkpoints import write_header_only, write_quantized
from published_models import published_config, published_tensors

from kvledger.engine.checkpoint.contents import read_weights
from kvledger.engine.checkpoint.model_config import SERVED_WEIGHTS
from kvledger.engine.cli import main
from kvledger.engine.errors import BadInput
from kvledger.engine.planner.plan import make_plan
from kvledger.engine.settings.config import EngineConfig

GiB = 2**30


def _plan(model_dir, **flags):
    flags = {"device_memory_bytes": 80 * GiB, **flags}
    return make_plan(EngineConfig(model=str(model_dir), **flags))


def test_an_fp8_checkpoint_plans_at_its_stored_bytes(tmp_path, capsys) -> None:
    write_quantized(tmp_path, "fp8")  # BF16 embeddings and norms, F8_E4M3 linears, F32 scales
    weights = read_weights(tmp_path)
    stored = weights.total_bytes
    plan = _plan(tmp_path)
    assert plan.fits and plan.classes["weights"] == stored
    fp8 = weights.bytes_by_dtype["F8_E4M3"]
    # --dtype float32: the BF16 tensors double, the FP8 weights and F32 scales do not.
    bf16 = weights.bytes_by_dtype["BF16"]
    assert _plan(tmp_path, dtype="float32").classes["weights"] == stored + bf16
    assert fp8 * 2 > stored  # the linear layers are most of it: FP8 is the saving
    assert main(["plan", "--model", str(tmp_path), "--device-memory", "24GiB"]) == 0
    assert "(fp8: linear layers f8_e4m3, the rest bf16" in capsys.readouterr().out


def test_scales_stored_in_bf16_are_counted_as_the_float32_the_engine_holds(tmp_path) -> None:
    from budget_checkpoints import llama_shapes

    config = write_quantized(tmp_path, "fp8")
    tensors = {}
    for name, shape in llama_shapes(config).items():
        layer = name.removesuffix(".weight")
        if layer.endswith("_proj"):  # llm-compressor stores some scales in bfloat16
            tensors |= {f"{layer}.weight": ("F8_E4M3", shape),
                        f"{layer}.weight_scale": ("BF16", [])}
        else:
            tensors[name] = ("BF16", shape)
    write_header_only(tmp_path, config, tensors)
    scales = sum(1 for n in tensors if n.endswith("weight_scale"))
    assert _plan(tmp_path).classes["weights"] == read_weights(tmp_path).total_bytes + 2 * scales


def test_quantization_fp8_plans_llama_3_8b_at_its_fp8_size(tmp_path) -> None:
    """The issue's figure: Llama-3.1-8B under --quantization fp8, about 8.46 GiB (linear
    layers at one byte and a float32 scale per output channel; the embeddings and LM head
    at bfloat16)."""
    config = published_config("Llama-3-8B")
    write_header_only(tmp_path, config, published_tensors(config))
    bf16 = _plan(tmp_path, max_model_len=4096).classes["weights"]
    fp8 = _plan(tmp_path, max_model_len=4096, quantization="fp8").classes["weights"]
    assert round(bf16 / GiB, 2) == 14.96
    assert round(fp8 / GiB, 2) == 8.46
    layers, hidden, inter, kv = 32, 4096, 14336, 1024
    linear = layers * (2 * hidden * hidden + 2 * kv * hidden + 3 * inter * hidden)
    channels = layers * (2 * hidden + 2 * kv + 2 * inter + hidden)
    assert bf16 - fp8 == linear - 4 * channels  # each weight: 2 bytes -> 1, plus the scales


def test_fp8_layers_add_their_dequantization_workspace_to_activations(tmp_path) -> None:
    """One layer's weight dequantized at a time (the MLP's, the largest): its float16 bits
    and its bf16 copy; dynamic activations need nothing else."""
    config = published_config("Llama-3-8B")
    write_header_only(tmp_path, config, published_tensors(config))
    plain = _plan(tmp_path, max_model_len=4096).classes["activations"]
    fp8 = _plan(tmp_path, max_model_len=4096, quantization="fp8").classes["activations"]
    assert fp8 - plain == 14336 * 4096 * (2 + 2)


def test_quantization_fp8_is_offered_when_only_fp8_weights_fit(tmp_path, capsys) -> None:
    """bf16 Llama-3-8B on 16 GiB: nothing but smaller weights fits; the remedy is re-planned
    as every remedy is, and the line it names plans as "fits"."""
    config = published_config("Llama-3-8B")
    write_header_only(tmp_path, config, published_tensors(config))
    flags = {"device_memory_bytes": 16 * GiB, "max_model_len": 4096, "max_num_seqs": 2}
    plan = make_plan(EngineConfig(model=str(tmp_path), **flags))
    assert not plan.fits
    assert [(r.flag, r.value) for r in plan.remedies] == [("--quantization", "fp8"),
                                                          ("--tensor-parallel-size", 2)]
    assert "weights -> 8.5 GiB" in plan.remedies[0].note
    argv = ["plan", "--model", str(tmp_path), "--device-memory", "16GiB", "--max-model-len",
            "4096", "--max-num-seqs", "2"]
    assert main(argv) == 3 and "--quantization fp8" in capsys.readouterr().err
    assert main([*argv, "--quantization", "fp8"]) == 0


@pytest.mark.parametrize("quant, why", [
    ({"quant_method": "fp8", "weight_block_size": [128, 128]}, "block-wise weight scales"),
    ({"quant_method": "fp8", "fmt": "e5m2"}, "fmt 'e5m2'"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized",
      "config_groups": {"g": {"weights": {"num_bits": 8, "type": "float", "strategy": "block"}}}},
     "config_groups.g.weights"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized",
      "kv_cache_scheme": {"num_bits": 8, "type": "int", "strategy": "tensor"}},
     "kv_cache_scheme {'num_bits': 8, 'type': 'int', 'strategy': 'tensor'} (FP8 per tensor, "
     "static scales only)"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized",
      "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "head"}},
     "kv_cache_scheme {'num_bits': 8, 'type': 'float', 'strategy': 'head'}"),
])
def test_fp8_variants_the_engine_does_not_serve_are_refused_by_name(tmp_path, capsys, quant,
                                                                   why) -> None:
    import json

    config = {**write_quantized(tmp_path, "fp8"), "quantization_config": quant}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert main(["plan", "--model", str(tmp_path), "--device-memory", "24GiB"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: checkpoint's FP8 quantization has {why}")
    assert err.endswith(f"; {SERVED_WEIGHTS}\n") and err.count("\n") == 1


def test_a_scale_beside_a_weight_not_stored_as_fp8_is_refused(tmp_path) -> None:
    config = write_quantized(tmp_path, "fp8")
    from budget_checkpoints import llama_shapes

    tensors = {name: ("BF16", shape) for name, shape in llama_shapes(config).items()}
    tensors["model.layers.0.mlp.up_proj.weight_scale"] = ("F32", [])
    write_header_only(tmp_path, config, tensors)
    with pytest.raises(BadInput, match=r"^FP8 checkpoint has a weight_scale for weights not "
                                       r"stored as F8_E4M3: 'model.layers.0.mlp.up_proj.weight' "
                                       r"as BF16; kvledger's engine serves"):
        _plan(tmp_path)


def test_quantization_other_than_fp8_is_refused_in_one_line(tmp_path, capsys) -> None:
    write_quantized(tmp_path, "fp8")
    assert main(["plan", "--model", str(tmp_path), "--device-memory", "24GiB",
                 "--quantization", "awq"]) == 2
    assert capsys.readouterr().err == (
        "error: --quantization awq: kvledger does not support vLLM's --quantization awq (only "
        "fp8, quantized on load; a checkpoint's own FP8, GPTQ, AWQ or compressed-tensors "
        "quantization_config needs no flag: drop it)\n")
    with pytest.raises(BadInput, match=r"^--quantization gptq: kvledger does not support"):
        EngineConfig(model=str(tmp_path), quantization="gptq")
