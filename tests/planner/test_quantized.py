"""Quantized checkpoints: for an architecture kvledger's engine serves, refused by name
(exit 2, one line) by ``plan`` and ``preflight`` before anything is planned, never a plan
that "fits" for a checkpoint ``serve`` would refuse; a what-if architecture keeps its
vLLM plan (``engine/checkpoint/loadable.py``). ``serve`` and ``run``: tests/server and
tests/operator."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from budget_checkpoints import (
    PUBLISHED_4BIT,
    QUANTIZED_LINEAR,
    TINY,
    llama_shapes,
    tensor_bytes,
    write_checkpoint,
    write_quantized,
)
from published_models import published_config, published_tensors

from kvledger.engine.checkpoint.contents import read_weights
from kvledger.engine.checkpoint.int4_format import SERVED_4BIT
from kvledger.engine.checkpoint.loadable import loadable_config, unexpected_tensors
from kvledger.engine.checkpoint.model_config import SERVED_WEIGHTS, ModelConfig
from kvledger.engine.cli import main
from kvledger.engine.errors import BadInput
from kvledger.engine.planner.plan import make_plan
from kvledger.engine.settings.config import EngineConfig

# fp8 (tests/planner/test_fp8_plan.py) and 4-bit gptq, awq and compressed-tensors W4A16
# (below) are served; these are not.
METHODS = ["bitsandbytes", "mxfp4", "gguf", "hqq"]


def _one_line_exit_2(argv: list[str], capsys) -> str:
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1, captured
    assert captured.err.startswith("error: ") and "Traceback" not in captured.err
    return captured.err[len("error: "):].rstrip("\n")


@pytest.mark.parametrize("method", METHODS)
def test_plan_and_preflight_refuse_a_quantized_checkpoint_by_its_method(tmp_path, capsys,
                                                                        method) -> None:
    model = tmp_path / method
    write_quantized(model, method)
    expected = (f"checkpoint is quantized with {method!r} (quantization_config.quant_method); "
                "kvledger's engine serves unquantized float16/bfloat16/float32 checkpoints, "
                "FP8 ones (quant_method 'fp8', or 'compressed-tensors' float-quantized: e4m3 "
                "weights, per-tensor or per-channel scales) and 4-bit ones ('gptq', 'awq' gemm, "
                "'compressed-tensors' pack-quantized W4A16)")
    assert expected.endswith(SERVED_WEIGHTS)
    flags = ["--model", str(model), "--device-memory", "24GiB"]
    assert _one_line_exit_2(["plan", *flags], capsys) == expected
    assert _one_line_exit_2(["plan", *flags, "--json"], capsys) == expected
    plan_out, log = tmp_path / "plan.json", tmp_path / "termination-log"
    assert _one_line_exit_2(["preflight", *flags, "--plan-out", str(plan_out),
                             "--termination-log", str(log)], capsys) == expected
    assert not plan_out.exists() and not log.exists()  # refused before anything is planned


@pytest.mark.parametrize("method", ["gptq", "awq", "compressed-tensors"])
def test_a_4bit_checkpoint_is_planned_as_stored_and_the_rest_at_the_model_dtype(
        tmp_path, capsys, method) -> None:
    """The packed layers' tensors (codes, zeros, g_idx, scales) count exactly as stored;
    the embeddings, LM head and norms (stored bf16 here) at the model dtype asked for."""
    write_quantized(tmp_path, method, quantization_config=PUBLISHED_4BIT[method])
    packed = unquantized = 0
    for name, shape in llama_shapes(TINY).items():
        if name.removesuffix(".weight").endswith("_proj"):
            packed += sum(tensor_bytes(*spec) for spec in QUANTIZED_LINEAR[method](*shape).values())
        else:
            unquantized += tensor_bytes("BF16", shape)
    for dtype, factor in (("bfloat16", 1), ("float32", 2)):
        plan = make_plan(EngineConfig(model=str(tmp_path), dtype=dtype,
                                      device_memory_bytes=24 * 2**30))
        assert plan.fits and plan.classes["weights"] == packed + factor * unquantized
        workspace = max(TINY["intermediate_size"], TINY["hidden_size"]) * TINY["hidden_size"] * 8
        write_checkpoint(tmp_path / "plain")
        unquantized_plan = make_plan(EngineConfig(model=str(tmp_path / "plain"), dtype=dtype,
                                                  device_memory_bytes=24 * 2**30))
        assert plan.classes["activations"] == unquantized_plan.classes["activations"] + workspace
    assert main(["plan", "--model", str(tmp_path), "--device-memory", "24GiB"]) == 0
    assert f"{method}: linear layers 4-bit as stored, the rest bf16" in capsys.readouterr().out


@pytest.mark.parametrize("quantization_config, what", [
    ({"quant_method": "gptq", "bits": 8, "group_size": 128}, "gptq bits 8"),
    ({"quant_method": "gptq", "group_size": 128}, "gptq bits None"),
    ({**PUBLISHED_4BIT["gptq"], "checkpoint_format": "gptq_v2"}, "gptq checkpoint_format 'gptq_v2'"),
    ({**PUBLISHED_4BIT["gptq"], "lm_head": True}, "gptq lm_head true (a quantized LM head)"),
    ({**PUBLISHED_4BIT["awq"], "version": "exllama"}, "awq version 'exllama'"),
    ({**PUBLISHED_4BIT["awq"], "zero_point": False}, "awq zero_point false"),
    ({**PUBLISHED_4BIT["awq"], "bits": 3}, "awq bits 3"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {
        "group_0": {"weights": {"num_bits": 4, "type": "int", "strategy": "group",
                                "group_size": 128, "actorder": "group"}}}},
     "compressed-tensors config_groups.group_0.weights"),
])
def test_a_4bit_variant_the_engine_does_not_serve_is_refused_by_name(
        tmp_path, capsys, quantization_config, what) -> None:
    method = quantization_config["quant_method"]
    write_quantized(tmp_path, method, quantization_config=quantization_config)
    line = _one_line_exit_2(["plan", "--model", str(tmp_path), "--device-memory", "24GiB"], capsys)
    assert line.startswith(f"checkpoint's 4-bit quantization has {what}")
    assert line.endswith(f"; {SERVED_4BIT}")


def test_a_4bit_layer_with_a_tensor_missing_or_of_the_wrong_dtype_is_refused(tmp_path, capsys):
    from budget_checkpoints import write_header_only

    config = {**TINY, "quantization_config": PUBLISHED_4BIT["gptq"]}
    tensors = {}
    for name, shape in llama_shapes(TINY).items():
        layer = name.removesuffix(".weight")
        if layer.endswith("_proj"):
            tensors |= {f"{layer}.{p}": s for p, s in QUANTIZED_LINEAR["gptq"](*shape).items()}
        else:
            tensors[name] = ("BF16", shape)
    del tensors["model.layers.0.mlp.up_proj.qzeros"]
    tensors["model.layers.1.mlp.up_proj.qweight"] = ("F16", [16, 128])
    write_header_only(tmp_path, config, tensors)
    line = _one_line_exit_2(["plan", "--model", str(tmp_path), "--device-memory", "24GiB"], capsys)
    assert line.startswith("gptq checkpoint has 4-bit layers the engine cannot load: "
                           "'model.layers.0.mlp.up_proj.qzeros' as missing, "
                           "'model.layers.1.mlp.up_proj.qweight' as F16 (codes, zeros")


def test_any_other_method_and_none_named_are_refused_too(tmp_path) -> None:
    write_checkpoint(tmp_path, quantization_config={"quant_method": "quark", "bits": 8})
    with pytest.raises(BadInput, match="quantized with 'quark'"):
        make_plan_for(tmp_path)
    write_checkpoint(tmp_path, quantization_config={"bits": 4})
    with pytest.raises(BadInput, match=r"^checkpoint is quantized \(config.json has a "
                                       r"quantization_config, with no quant_method\); kvledger's"):
        make_plan_for(tmp_path)
    write_checkpoint(tmp_path, quantization_config=None)  # transformers writes null for none
    assert make_plan_for(tmp_path).fits


def make_plan_for(model_dir):
    from kvledger.engine.settings.config import EngineConfig

    return make_plan(EngineConfig(model=str(model_dir), device_memory_bytes=24 * 2**30))


@pytest.mark.parametrize("method", ["fp8", "gptq", "awq", "bitsandbytes", "mxfp4",
                                    "compressed-tensors"])
def test_quantized_tensors_without_a_quantization_config_are_refused_by_name(
        tmp_path, capsys, method) -> None:
    """Scales (fp8's input_scale, GPTQ's qweight/qzeros/g_idx ...) with nothing in
    config.json to say so: the loader would refuse them as unexpected, so the plan does."""
    write_quantized(tmp_path, method, quantization_config=False)
    flags = ["--model", str(tmp_path), "--device-memory", "24GiB"]
    for command in ("plan", "preflight"):
        line = _one_line_exit_2([command, *flags, "--termination-log", str(tmp_path / "log")]
                                if command == "preflight" else [command, *flags], capsys)
        assert line.startswith("checkpoint has tensors kvledger's engine does not load for "
                               "LlamaForCausalLM: 'model.layers.0.mlp.down_proj.")
        assert line.endswith(" more (quantized weights and scales without a "
                             "quantization_config, or another model's tensors); "
                             f"{SERVED_WEIGHTS}")
        named = line.split(": ", 1)[1].split(" and ")[0].split(", ")
        assert len(named) == 3
        stored = set(QUANTIZED_LINEAR[method](64, 64)) - {"weight"}  # what the loader refuses
        assert all(name.strip("'").startswith("model.layers.0.mlp.") for name in named)
        assert {name.strip("'").split("_proj.")[1] for name in named} <= stored


@pytest.mark.parametrize("dtype", ["F8_E4M3", "I8", "U8"])
def test_weights_stored_as_no_float_are_refused(tmp_path, capsys, dtype) -> None:
    """Names the engine knows, but not values it can cast: fp8 or int8 weights saved
    without their scales or a quantization_config would load as garbage."""
    from budget_checkpoints import TINY, llama_shapes, write_header_only

    tensors = {name: ("BF16", shape) for name, shape in llama_shapes(TINY).items()}
    for layer in range(2):
        for proj in ("q", "k"):
            name = f"model.layers.{layer}.self_attn.{proj}_proj.weight"
            tensors[name] = (dtype, tensors[name][1])
    write_header_only(tmp_path, TINY, tensors)
    line = _one_line_exit_2(["plan", "--model", str(tmp_path), "--device-memory", "8GiB"],
                            capsys)
    assert line == (f"checkpoint stores weights in a dtype that is not a float: "
                    f"'model.layers.0.self_attn.k_proj.weight' as {dtype}, "
                    f"'model.layers.0.self_attn.q_proj.weight' as {dtype}, "
                    f"'model.layers.1.self_attn.k_proj.weight' as {dtype} and 1 more "
                    f"(quantized weights?); {SERVED_WEIGHTS}")


def test_fp8_scales_are_named_when_the_dtype_is_a_float(tmp_path, capsys) -> None:
    """The issue's crash: an fp8 checkpoint's input_scale and weight_scale beside weights
    the engine knows; named even when the weights themselves are stored in bf16."""
    config = json.loads(json.dumps(published_config("Llama-3-8B")))
    config.update(num_hidden_layers=1, vocab_size=64, hidden_size=64, intermediate_size=128,
                  num_attention_heads=4, num_key_value_heads=2)
    tensors = published_tensors(config)
    tensors |= {"model.layers.0.self_attn.q_proj.input_scale": ("F32", []),
                "model.layers.0.self_attn.q_proj.weight_scale": ("F32", [])}
    from budget_checkpoints import write_header_only

    write_header_only(tmp_path, config, tensors)
    line = _one_line_exit_2(["plan", "--model", str(tmp_path), "--device-memory", "8GiB"],
                            capsys)
    assert line.startswith("checkpoint has tensors kvledger's engine does not load for "
                           "LlamaForCausalLM: 'model.layers.0.self_attn.q_proj.input_scale', "
                           "'model.layers.0.self_attn.q_proj.weight_scale' (quantized weights and "
                           "scales without a quantization_config, ")


def test_the_refusal_through_a_subprocess_is_one_line(tmp_path) -> None:
    write_quantized(tmp_path, "awq", quantization_config={"quant_method": "awq", "bits": 4,
                                                          "version": "gemv"})
    proc = subprocess.run([sys.executable, "-m", "kvledger.engine.cli", "plan", "--model",
                           str(tmp_path), "--device-memory", "24GiB"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == ("error: checkpoint's 4-bit quantization has awq version 'gemv'; "
                           f"{SERVED_4BIT}\n")


@pytest.mark.parametrize("name", ["gpt-oss-20b", "DeepSeek-V3"])
def test_a_what_if_architecture_keeps_its_vllm_plan(tmp_path, capsys, name) -> None:
    """gpt-oss (MXFP4) and DeepSeek-V3 (fp8) are planned for vLLM as they are stored; the
    report says that kvledger's engine does not serve them, and the pre-flight refuses
    them by architecture (a pod never runs an engine that would crash)."""
    config = published_config(name)
    if name == "DeepSeek-V3":  # 3 dense layers, 2 of experts: enough
        config["num_hidden_layers"] = 5
    from budget_checkpoints import write_header_only

    write_header_only(tmp_path, config, published_tensors(config))
    assert main(["plan", "--model", str(tmp_path), "--device-memory", "192GiB",
                 "--max-model-len", "4096"]) == 0
    out = capsys.readouterr().out
    quant = config["quantization_config"]["quant_method"]
    assert f"kvledger's engine does not serve {config['architectures'][0]}" in out
    assert f"({quant} (" in out  # the weights row names the method they are stored in
    line = _one_line_exit_2(["preflight", "--model", str(tmp_path), "--device-memory",
                             "192GiB", "--max-model-len", "4096", "--termination-log",
                             str(tmp_path / "log")], capsys)
    assert line.startswith(f"unsupported architecture {config['architectures'][0]}")


def test_an_unquantized_checkpoint_has_nothing_unexpected(make_model_dir) -> None:
    """Every built-in model (dense, biased, qk-norm, mixture-of-experts, tied) passes the
    check: the engine's tensor names are its checkpoints'."""
    from kvledger.engine.checkpoint.hf_config import read_config_json
    from kvledger.engine.model.builtin import MODELS

    for name in MODELS:
        model_dir = make_model_dir(name)
        weights = read_weights(model_dir)
        config = loadable_config(read_config_json(model_dir), weights.tensors)
        assert config == ModelConfig.from_dir(model_dir)
        assert unexpected_tensors(weights.tensors, config) == []
