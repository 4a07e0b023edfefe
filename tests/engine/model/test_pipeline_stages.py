"""Pipeline stages in the engine (``model/pipeline.py``): each stage loads only its own
tensors, exactly the bytes the plan gives that stage; and the stages run one after the
other compute what the whole model computes (greedy tokens equal), for several
architectures (untied Llama, tied Qwen2 and Qwen3, Mixtral's experts) and checkpoints
transformers wrote (a Llama; a Granite and a Granite-MoE, their multipliers on the first
and last stage; a Phi-3, its fused projections split as each stage reads them)."""

from __future__ import annotations

import pytest
import torch
from _tiny_models import save_tiny

from kvledger.engine.checkpoint.model_config import ModelConfig
from kvledger.engine.model.attention import AttentionMetadata, PrefillSpan
from kvledger.engine.model.loader import load_model, weights_bytes
from kvledger.engine.model.pipeline import Stage
from kvledger.engine.model.transformer import RotaryEmbedding
from kvledger.engine.planner.plan import make_plan
from kvledger.engine.settings.config import EngineConfig

CPU = torch.device("cpu")
CASES = [("tiny-llama", 2), ("tiny-llama", 4), ("small-llama", 2), ("small-llama", 4),
         ("tiny-qwen2", 2), ("tiny-qwen3", 3), ("tiny-mixtral", 2)]


@pytest.fixture(scope="module")
def hf_llama_dir(tmp_path_factory):
    """A Llama checkpoint as transformers writes it (``save_pretrained``), random weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=160,
                         num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, tie_word_embeddings=False)
    folder = tmp_path_factory.mktemp("hf-llama")
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory, hf_llama_dir):
    """transformers' own checkpoints by name: the Llama above, a Granite, a Granite-MoE, a
    Phi-3 (4 layers each; the Phi-3 with partial rotary)."""
    root = tmp_path_factory.mktemp("hf-stages")
    return {"hf-llama": hf_llama_dir,
            "hf-granite": save_tiny("granite", root / "granite", num_hidden_layers=4),
            "hf-granitemoe": save_tiny("granitemoe", root / "granitemoe", num_hidden_layers=4),
            "hf-phi3": save_tiny("phi3", root / "phi3", num_hidden_layers=4,
                                 partial_rotary_factor=0.75)}


def model_dir(name, make_model_dir, hf_dirs):
    return hf_dirs[name] if name.startswith("hf-") else make_model_dir(name)


@pytest.mark.parametrize(("name", "stages"), [*CASES, ("hf-llama", 2), ("hf-llama", 3),
                                             ("hf-granite", 2), ("hf-granitemoe", 2),
                                             ("hf-phi3", 2)])
def test_each_stage_loads_exactly_the_bytes_its_plan_gives(name, stages, make_model_dir,
                                                            hf_dirs):
    folder = model_dir(name, make_model_dir, hf_dirs)
    config = ModelConfig.from_dir(folder)
    plan = make_plan(EngineConfig(model=str(folder), device="cpu", max_model_len=128,
                                  pipeline_parallel_size=stages))
    whole = weights_bytes(load_model(folder, config, torch.float32, CPU))
    loaded = []
    for s in range(stages):
        stage = Stage.of(config, s, stages)
        model = load_model(folder, config, torch.float32, CPU, stage=stage)
        assert (stage.first_layer, stage.end_layer) == (plan.stages[s].first_layer,
                                                        plan.stages[s].end_layer)
        assert len(model.model.layers) == stage.end_layer - stage.first_layer
        loaded.append(weights_bytes(model))
    assert loaded == [f.classes["weights"] for f in plan.stages]
    embedding = config.vocab_size * config.hidden_size * 4
    assert sum(loaded) == whole + (embedding if config.tie_word_embeddings else 0)


def forward(models, config, ids: list[int]) -> torch.Tensor:
    """The last token's logits, the stages run one after the other (no KV cache)."""
    rope = RotaryEmbedding(config, 256, CPU, torch.float32)
    cos, sin = rope.lookup(torch.arange(len(ids)))
    meta = AttentionMetadata(None, [PrefillSpan(0, len(ids), None)], [])
    x = torch.tensor(ids)
    for model in models:
        x = model(x, cos, sin, None, meta)
    return models[-1].logits(x[-1:])[0]


@pytest.mark.parametrize(("name", "stages"), [*CASES, ("hf-llama", 3), ("hf-granite", 2),
                                             ("hf-granitemoe", 3), ("hf-phi3", 3)])
@torch.inference_mode()
def test_stages_one_after_the_other_compute_what_the_whole_model_does(
        name, stages, make_model_dir, hf_dirs):
    folder = model_dir(name, make_model_dir, hf_dirs)
    config = ModelConfig.from_dir(folder)
    whole = [load_model(folder, config, torch.float32, CPU)]
    staged = [load_model(folder, config, torch.float32, CPU, stage=Stage.of(config, s, stages))
              for s in range(stages)]
    prompt = [5, 17, 42, 7, 99, 3]
    ids_whole, ids_staged = list(prompt), list(prompt)
    for _ in range(8):  # greedy, the whole prefix each time
        expected, got = forward(whole, config, ids_whole), forward(staged, config, ids_staged)
        torch.testing.assert_close(got, expected)
        ids_whole.append(int(expected.argmax()))
        ids_staged.append(int(got.argmax()))
    assert ids_staged == ids_whole


def test_a_stage_reads_only_its_own_tensors(make_model_dir, monkeypatch):
    """The loader takes this stage's tensors alone from the files' maps: the rest stay on
    disk."""
    from kvledger.engine.model import mapped_file

    folder = make_model_dir("small-llama")
    config = ModelConfig.from_dir(folder)
    read: list[str] = []
    real = mapped_file.MappedFile.tensor

    def counting(self, name):
        read.append(name)
        return real(self, name)

    monkeypatch.setattr(mapped_file.MappedFile, "tensor", counting)
    load_model(folder, config, torch.float32, CPU, stage=Stage.of(config, 1, 2))
    assert read and all("embed_tokens" not in n for n in read)
    layers = {int(n.split(".")[2]) for n in read if ".layers." in n}
    assert layers == set(range(4, 8))
