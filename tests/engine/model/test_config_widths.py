"""config.json's widths against the checkpoint's tensors: the plan and the loader agree.

The planner sizes activations, the KV cache and the logits from config.json's widths
(``hidden_size``, ``intermediate_size``, heads, ``head_dim``, ``vocab_size``, an expert's
width); the loader refuses tensors whose shapes those widths do not give. A config.json
that states a width other than its tensors' (a hand-edited file, a stripped ``head_dim``, a
tenant's hostile repo) planned a run that "fits" on numbers the engine then refuses, in
the tenant's own pod after it was sized. Here, for checkpoints written by transformers
and by the formats' own tools, every width changed up and down: the pre-flight's check
(``loadable_config``) refuses exactly when the loader does, naming the tensor, and
``kvledger plan`` exits 2 with that one line.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from _fp8_checkpoints import write_fp8
from _int4_checkpoints import write_int4
from _tiny_models import ENGINE_MODELS, save_tiny

from kvledger.engine.checkpoint.contents import read_weights
from kvledger.engine.checkpoint.loadable import loadable_config
from kvledger.engine.checkpoint.model_config import ModelConfig
from kvledger.engine.cli import main
from kvledger.engine.errors import BadInput
from kvledger.engine.model.loader import load_model

# The engine's architectures as transformers writes them; Qwen3's head_dim is not
# hidden / heads, so a config without it is a wrong one.
_TRANSFORMERS = {name: {"head_dim": 16} if name.startswith("qwen3") else {}
                 for name in ENGINE_MODELS}
# Written from the built-in tiny-llama by the formats' own layouts (tests/_*_checkpoints).
_QUANTIZED = ("fp8", "gptq", "awq", "compressed-tensors")
WIDTHS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
          "head_dim", "vocab_size", "moe_intermediate_size")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory, make_model_dir) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("widths")
    written = {}
    for name, fields in _TRANSFORMERS.items():
        written[name] = save_tiny(name, root / name, **fields)
    source = make_model_dir("tiny-llama")
    written["fp8"] = write_fp8(source, root / "fp8", per_channel=True, static=False)[0]
    for method in _QUANTIZED[1:]:
        written[method] = write_int4(source, root / method, method)[0]
    return written


def _verdicts(model_dir: Path, raw: dict[str, Any]) -> tuple[str | None, str | None]:
    """What the pre-flight's check and the loader say of ``model_dir`` with config.json
    ``raw``: None where it takes it, else its refusal."""
    try:
        config = loadable_config(raw, read_weights(model_dir).tensors)
        planned = None
    except BadInput as exc:
        planned, config = str(exc), ModelConfig.from_dict(raw)
    try:
        load_model(model_dir, config, torch.float32, torch.device("cpu"))
        loaded = None
    except BadInput as exc:
        loaded = str(exc)
    return planned, loaded


def _mutations(raw: dict[str, Any]) -> list[tuple[str, int]]:
    """Each width config.json states, and each it leaves to a default (head_dim), set to
    half and to twice what the tensors hold."""
    widths = {key: raw[key] for key in WIDTHS if isinstance(raw.get(key), int)}
    widths.setdefault("head_dim", raw["hidden_size"] // raw["num_attention_heads"])
    return [(key, value) for key, width in widths.items() for value in (width // 2, width * 2)]


# Widths no tensor of the checkpoint has: Qwen3-MoE's dense intermediate_size where every
# layer holds experts (mlp_only_layers empty). Both take any value there.
UNHELD = {"qwen3moe": {"intermediate_size"}}


@pytest.mark.parametrize("name", [*_TRANSFORMERS, *_QUANTIZED])
def test_a_width_other_than_the_tensors_is_refused_by_the_plan_as_by_the_loader(checkpoints,
                                                                              name) -> None:
    model_dir = checkpoints[name]
    raw = json.loads((model_dir / "config.json").read_text())
    assert _verdicts(model_dir, raw) == (None, None)
    refused = set()
    for key, value in _mutations(raw):
        changed = {**raw, key: value}
        try:
            ModelConfig.from_dict(changed)
        except BadInput:
            refused.add(key)  # from config.json alone (heads not divisible, say)
            continue
        planned, loaded = _verdicts(model_dir, changed)
        assert (planned is None) == (loaded is None), \
            f"{key} {value}: the plan says {planned!r}, the loader {loaded!r}"
        if planned is not None:
            refused.add(key)
            assert "\n" not in planned and "is [" in planned and "expected" in planned, planned
    assert refused == {key for key, _ in _mutations(raw)} - UNHELD.get(name, set())


def test_kvledger_plan_refuses_a_config_stating_fewer_kv_heads_than_stored(checkpoints, tmp_path,
                                                                         capsys) -> None:
    """A Llama config.json saying one KV head where the checkpoint stores two (an MQA
    conversion half done): planned before with half the KV cache per token, a run that
    "fits" and then fails to load in its pod; now ``kvledger plan`` exits 2 with one
    line naming the tensor and the widths."""
    model_dir = tmp_path / "llama"
    model_dir.mkdir()
    for path in checkpoints["llama"].iterdir():
        if path.name != "config.json":
            (model_dir / path.name).symlink_to(path)
    raw = json.loads((checkpoints["llama"] / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**raw, "num_key_value_heads": 1}))
    rc = main(["plan", "--model", str(model_dir), "--device-memory", "24GiB"])
    out, err = capsys.readouterr()
    assert rc == 2 and out == "" and err.count("\n") == 1, err
    assert "'model.layers.0.self_attn.k_proj.weight' is [16, 32], expected [8, 32]" in err
    assert "num_key_value_heads 1, head_dim 8" in err


def test_fused_experts_of_another_width_are_refused(checkpoints, tmp_path) -> None:
    """transformers 5's fused experts (``gate_up_proj`` ``[experts, 2 * inter, hidden]``)
    split by the loader into each expert's gate and up: a config whose expert width is not
    the tensor's is refused by the plan as by the loader."""
    import transformers

    source = checkpoints["qwen3moe"]
    model = transformers.AutoModelForCausalLM.from_pretrained(source)
    fused = tmp_path / "fused"
    model.save_pretrained(fused, save_original_format=False)
    header = {t.name: t.shape for t in read_weights(fused).tensors}
    assert header["model.layers.0.mlp.experts.gate_up_proj"] == (4, 32, 32)
    raw = json.loads((fused / "config.json").read_text())
    planned, loaded = _verdicts(fused, {**raw, "moe_intermediate_size": 8})
    assert loaded is not None
    assert planned is not None and ("'model.layers.0.mlp.experts.gate_up_proj' is [4, 32, 32], "
                                    "expected [4, 16, 32]") in planned, planned


@pytest.mark.parametrize(("name", "part"), [
    ("gptq", "qweight"), ("gptq", "qzeros"), ("gptq", "g_idx"), ("awq", "qweight"),
    ("awq", "qzeros"), ("compressed-tensors", "weight_packed"), ("fp8", "weight_scale"),
])
def test_a_quantized_layer_stored_in_another_shape_is_refused_by_the_plan(checkpoints, tmp_path,
                                                                         name, part) -> None:
    """One quantized layer's packed tensor (or FP8 scale) a row longer than its layer's
    shape gives: the plan refuses it, as the loader does, naming it."""
    from safetensors.torch import load_file, save_file

    model_dir = tmp_path / name
    model_dir.mkdir()
    for path in checkpoints[name].iterdir():
        if path.name != "model.safetensors":
            (model_dir / path.name).symlink_to(path)
    tensors = load_file(str(checkpoints[name] / "model.safetensors"))
    victim = f"model.layers.1.mlp.down_proj.{part}"
    tensors[victim] = torch.cat([tensors[victim], tensors[victim][:1]])
    save_file(tensors, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    raw = json.loads((model_dir / "config.json").read_text())
    planned, loaded = _verdicts(model_dir, raw)
    assert planned is not None and f"'{victim}' is [" in planned, planned
    assert loaded is not None, "the loader took it"
