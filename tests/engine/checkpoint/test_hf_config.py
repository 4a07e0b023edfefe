"""config.json read once (``kvledger.engine.checkpoint.hf_config``): the planner and the engine
read every config alike, as transformers reads it, and the engine refuses by name what it
cannot run."""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path

import pytest
import torch

from kvledger.engine.checkpoint.contents import ModelShape, model_shape
from kvledger.engine.checkpoint.model_config import ModelConfig
from kvledger.engine.errors import BadInput
from kvledger.engine.model.builtin import MODELS
from kvledger.engine.model.loader import load_model
from kvledger.engine.planner.device import DeviceMemory
from kvledger.engine.planner.plan import make_plan
from kvledger.engine.settings.config import EngineConfig

transformers = pytest.importorskip("transformers")

WHAT_IF = DeviceMemory("what-if", "x", 2**36, 2**36, False)
DROP = object()  # a key the edge case removes
# Built-in checkpoints with config.json changed where the planner and the engine could
# read it apart; each still loads the built-in weights.
EDGE_CASES = {
    # transformers writes "head_dim": null (Mixtral's and others'): hidden / heads.
    "mixtral-head-dim-null": ("tiny-mixtral", {"head_dim": None}),
    "llama-head-dim-null": ("tiny-llama", {"head_dim": None}),
    "mistral-window-null": ("tiny-mistral", {"sliding_window": None}),
    "qwen2-window-every-layer": ("tiny-qwen2", {"use_sliding_window": True,
                                                "sliding_window": 32, "max_window_layers": 0}),
    # No max_window_layers: transformers' 28, so none of the 3 layers slides.
    "qwen2-window-default-layers": ("tiny-qwen2", {"use_sliding_window": True,
                                                   "sliding_window": 32,
                                                   "max_window_layers": DROP}),
    "qwen3-window-layer-types": ("tiny-qwen3", {"use_sliding_window": True, "sliding_window": 32,
                                                "layer_types": ["sliding_attention"] * 3}),
    # Qwen3-MoE slides on every layer, whatever max_window_layers says.
    "qwen3-moe-window": ("tiny-qwen3-moe", {"use_sliding_window": True, "sliding_window": 32,
                                            "max_window_layers": 2}),
}


@pytest.fixture(scope="module")
def checkpoint(make_model_dir, tmp_path_factory):
    def make(name: str):
        if name in MODELS:
            return make_model_dir(name)
        base, change = EDGE_CASES[name]
        source, out = make_model_dir(base), tmp_path_factory.mktemp(name)
        (out / "model.safetensors").symlink_to(source / "model.safetensors")
        config = json.loads((source / "config.json").read_text()) | change
        config = {k: v for k, v in config.items() if v is not DROP}
        (out / "config.json").write_text(json.dumps(config))
        return out

    return make


def _planner_reading(model_dir) -> dict:
    shape = make_plan(EngineConfig(model=str(model_dir), max_model_len=64), device=WHAT_IF).shape
    return {"architecture": shape.architecture, "layers": shape.num_layers,
            "heads": shape.num_attention_heads, "kv_heads": shape.num_kv_heads,
            "head_dim": shape.head_dim, "hidden": shape.hidden_size,
            "intermediate": shape.intermediate_size, "vocab": shape.vocab_size,
            "context": shape.max_position_embeddings, "tied": shape.tie_word_embeddings,
            "windows": tuple(la.sliding_window for la in shape.kv_layout().layers)}


def _engine_reading(config: ModelConfig) -> dict:
    return {"architecture": config.architecture, "layers": config.num_layers,
            "heads": config.num_attention_heads, "kv_heads": config.num_kv_heads,
            "head_dim": config.head_dim, "hidden": config.hidden_size,
            "intermediate": config.intermediate_size, "vocab": config.vocab_size,
            "context": config.max_position_embeddings, "tied": config.tie_word_embeddings,
            "windows": (config.sliding_window,) * config.num_layers}


def _transformers_reading(model_dir) -> dict:
    """What transformers' config class (and its model: head_dim, where a window applies)
    makes of the same config.json."""
    hf = transformers.AutoConfig.from_pretrained(model_dir)
    heads, layers = hf.num_attention_heads, hf.num_hidden_layers
    window = getattr(hf, "sliding_window", None) if hf.model_type != "llama" else None
    kinds = getattr(hf, "layer_types", None) or ["sliding_attention"] * layers
    return {"architecture": hf.architectures[0], "layers": layers, "heads": heads,
            "kv_heads": hf.num_key_value_heads,
            "head_dim": getattr(hf, "head_dim", None) or hf.hidden_size // heads,
            "hidden": hf.hidden_size, "intermediate": hf.intermediate_size,
            "vocab": hf.vocab_size, "context": hf.max_position_embeddings,
            "tied": hf.tie_word_embeddings,
            "windows": tuple(window if kind == "sliding_attention" else None for kind in kinds)}


@pytest.mark.parametrize("name", [*MODELS, *EDGE_CASES])
def test_the_planner_and_the_engine_read_a_config_alike(checkpoint, name):
    """Planned and loaded: the same numbers field by field, transformers' too, and the
    loaded model's tensors have the shape the planner budgeted."""
    model_dir = checkpoint(name)
    config = ModelConfig.from_dir(model_dir)
    planned = _planner_reading(model_dir)
    assert planned == _engine_reading(config) == _transformers_reading(model_dir)
    # One record: the engine's config is the planner's shape, field for field, plus its own.
    raw = json.loads((Path(model_dir) / "config.json").read_text())
    assert isinstance(config, ModelShape)
    assert ({f.name: getattr(config, f.name) for f in fields(ModelShape)}
            == {f.name: getattr(model_shape(raw), f.name) for f in fields(ModelShape)})
    model = load_model(model_dir, config, torch.float32, torch.device("cpu"))
    attention = model.model.layers[0].self_attn
    assert attention.q_proj.weight.shape[0] == planned["heads"] * planned["head_dim"]
    assert attention.k_proj.weight.shape[0] == planned["kv_heads"] * planned["head_dim"]
    assert len(model.model.layers) == planned["layers"]
    assert tuple(model.model.embed_tokens.weight.shape) == (planned["vocab"], planned["hidden"])


def _qwen2(**change) -> dict:
    return {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 30, "num_attention_heads": 4,
            "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 512,
            **change}


def test_a_window_on_some_layers_is_planned_as_transformers_places_it_and_refused_by_the_engine():
    """Qwen2 with use_sliding_window and no max_window_layers: transformers slides from
    layer 28 on; the planner says so, and the engine, which applies one window to every
    layer, refuses it by name."""
    raw = _qwen2(use_sliding_window=True, sliding_window=32)
    hf = transformers.Qwen2Config(**{k: v for k, v in raw.items() if k != "architectures"})
    layers = model_shape(raw).kv_layout().layers
    assert [la.attention == "sliding" for la in layers] == [
        kind == "sliding_attention" for kind in hf.layer_types]
    assert sum(la.attention == "sliding" for la in layers) == 2
    with pytest.raises(BadInput, match="sliding window on only some layers"):
        ModelConfig.from_dict(raw)


def test_a_qwen3_without_head_dim_is_refused_alike_where_it_is_ambiguous():
    """Qwen3Config takes 128; where hidden / heads is not 128 the weights decide, so both
    refuse, with the same line; where it is 128 both read 128."""
    raw = _qwen2(architectures=["Qwen3ForCausalLM"], model_type="qwen3")
    message = r"Qwen3ForCausalLM without head_dim \(transformers takes 128, hidden_size / "
    with pytest.raises(BadInput, match=message):
        model_shape(raw)
    with pytest.raises(BadInput, match=message):
        ModelConfig.from_dict(raw)
    wide = {**raw, "hidden_size": 512}
    assert model_shape(wide).head_dim == ModelConfig.from_dict(wide).head_dim == 128


@pytest.mark.parametrize("change, message", [
    ({"architectures": ["FalconForCausalLM"]}, "unsupported architecture FalconForCausalLM"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "unsupported rope_scaling type 'yarn'"),
    ({"hidden_act": "gelu"}, "unsupported hidden_act"),
    ({"architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True, "sliding_window": 32,
      "max_window_layers": 2}, "sliding window on only some layers"),
    # Values that would turn every logit into NaN, or a traceback: refused at load.
    ({"rope_theta": -1}, "'rope_theta' must be a positive number, got -1"),
    ({"rope_theta": "x"}, "'rope_theta' must be a positive number, got 'x'"),
    ({"rms_norm_eps": -1e-5}, "'rms_norm_eps' must be a positive number"),
    ({"rope_parameters": {"rope_type": "llama3"}},
     "'rope_parameters.factor' must be a positive number, got None"),
    ({"rope_parameters": {"rope_type": "linear", "factor": "x"}},
     "'rope_parameters.factor' must be a positive number, got 'x'"),
    ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}},
     r"high_freq_factor \(4.0\) must be more than its low_freq_factor \(4.0\)"),
    ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0}},
     "config.json has no 'original_max_position_embeddings'"),
    ({"architectures": ["MistralForCausalLM"], "sliding_window": -5},
     "'sliding_window' must be a positive integer, got -5"),
    ({"architectures": ["Qwen3ForCausalLM"], "head_dim": 32, "use_sliding_window": True,
      "sliding_window": 32, "layer_types": ["full_attention", "sliding_attention"] * 2},
     "sliding window on only some layers"),
    ({"architectures": ["Qwen3ForCausalLM"], "hidden_size": 128, "num_attention_heads": 4},
     "Qwen3ForCausalLM without head_dim"),
    # Mixture-of-experts that would load and run wrong.
    ({"architectures": ["Qwen2MoeForCausalLM"]},
     r"unsupported architecture Qwen2MoeForCausalLM \(Qwen2-MoE's shared expert is not implemented\)"),
    ({"architectures": ["Qwen3MoeForCausalLM"], "num_experts": 8, "shared_expert_intermediate_size": 64},
     "unsupported: a shared expert"),
    ({"architectures": ["MixtralForCausalLM"], "scoring_func": "sigmoid"},
     "unsupported MoE router: scoring_func 'sigmoid'"),
    ({"architectures": ["Qwen3MoeForCausalLM"], "n_group": 8, "topk_group": 4},
     "unsupported MoE router: n_group 8"),
    ({"architectures": ["MixtralForCausalLM"], "num_local_experts": 2, "num_experts_per_tok": 3},
     "'num_experts_per_tok' 3 is more than the 2 experts"),
    ({"architectures": ["Qwen3MoeForCausalLM"], "decoder_sparse_step": 0},
     "'decoder_sparse_step' must be a positive integer"),
])
def test_model_config_refuses_what_it_cannot_run(tiny_llama_dir, change, message):
    raw = {**json.loads((tiny_llama_dir / "config.json").read_text()), **change}
    with pytest.raises(BadInput, match=message):
        ModelConfig.from_dict(raw)


@pytest.mark.parametrize("change, window", [
    ({}, None),
    ({"use_sliding_window": True, "sliding_window": 32}, None),  # max_window_layers 28 >= layers
    ({"use_sliding_window": True, "sliding_window": 32, "max_window_layers": 0}, 32),
    ({"use_sliding_window": True, "sliding_window": 32, "layer_types": ["sliding_attention"] * 4}, 32),
    ({"use_sliding_window": False, "sliding_window": 32, "max_window_layers": 0}, None),
])
@pytest.mark.parametrize("arch", ["Qwen2ForCausalLM", "Qwen3ForCausalLM"])
def test_qwen_sliding_window_as_transformers_reads_it(tiny_llama_dir, arch, change, window):
    raw = {**json.loads((tiny_llama_dir / "config.json").read_text()), "architectures": [arch],
           "head_dim": 32, **change}
    assert ModelConfig.from_dict(raw).sliding_window == window


def test_which_layers_have_experts_is_transformers_choice(tiny_llama_dir):
    """Qwen3-MoE: experts where (i + 1) % decoder_sparse_step == 0 and i not in
    mlp_only_layers; none at all with num_experts 0. Mixtral: every layer. Left out,
    num_experts_per_tok is each config class's default."""
    base = {**json.loads((tiny_llama_dir / "config.json").read_text()), "num_hidden_layers": 6,
            "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
            "moe_intermediate_size": 8, "num_experts_per_tok": 2}
    for change in ({"num_experts": 4}, {"num_experts": 4, "decoder_sparse_step": 2},
                   {"num_experts": 4, "decoder_sparse_step": 3, "mlp_only_layers": [2]},
                   {"num_experts": 4, "mlp_only_layers": [0, 5]}, {"num_experts": 0}):
        raw = {**base, **change}
        hf = transformers.Qwen3MoeConfig(**{k: v for k, v in raw.items() if k != "architectures"})
        with torch.device("meta"):
            layers = transformers.Qwen3MoeForCausalLM(hf).model.layers
        expected = tuple(i for i, layer in enumerate(layers) if hasattr(layer.mlp, "experts"))
        moe = ModelConfig.from_dict(raw).moe
        assert (moe.sparse_layers if moe else ()) == expected, change
    mixtral = ModelConfig.from_dict({**base, "architectures": ["MixtralForCausalLM"],
                                     "num_local_experts": 4}).moe
    assert mixtral.sparse_layers == tuple(range(6)) and mixtral.normalize_topk
    unsaid = {k: v for k, v in base.items() if k != "num_experts_per_tok"} | {"num_experts": 16}
    assert ModelConfig.from_dict(unsaid).moe.num_experts_per_tok == (
        transformers.Qwen3MoeConfig().num_experts_per_tok)
    unsaid["architectures"] = ["MixtralForCausalLM"]
    assert ModelConfig.from_dict(unsaid).moe.num_experts_per_tok == (
        transformers.MixtralConfig().num_experts_per_tok)


def test_transformers5_rope_parameters_are_read(tiny_llama_dir):
    raw = json.loads((tiny_llama_dir / "config.json").read_text())
    legacy = ModelConfig.from_dict(raw)
    scaling = raw.pop("rope_scaling")
    raw["rope_parameters"] = {**scaling, "rope_theta": raw.pop("rope_theta")}
    assert ModelConfig.from_dict(raw) == legacy


