"""Gemma 3 (its text model, and its multimodal checkpoints served as text) and Gemma 1,
written by transformers' own ``save_pretrained`` and served through kvledger's real path:
greedy tokens and logprobs equal transformers' on the same folder, with a sliding window
(8) shorter than the prompts and both kinds of layer, prefilled in chunks and decoded
across the window's edge, two sequences of different lengths at once; the plan counts
what the engine loads and keeps every layer's whole context, as the engine does."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from _tiny_models import save_tiny

from kvledger.engine import LLM, SamplingParams
from kvledger.engine.checkpoint.contents import read_weights
from kvledger.engine.checkpoint.loadable import loadable_config, tensor_names
from kvledger.engine.checkpoint.model_config import ModelConfig
from kvledger.engine.checkpoint.tensor_shapes import float_shapes
from kvledger.engine.cli import main
from kvledger.engine.errors import BadInput
from kvledger.engine.model.loader import load_model, model_class, weights_bytes
from kvledger.engine.planner.plan import loaded_weight_bytes
from kvledger.engine.planner.pool import ENGINE_RULE

transformers = pytest.importorskip("transformers")

WINDOW = 8
# Sliding, full, sliding: both RoPEs (the full layers' scaled, linear x8), both masks; a
# query scale other than head_dim's (query_pre_attn_scalar 12, head_dim 8).
GEMMA3 = {"sliding_window": WINDOW, "num_hidden_layers": 3, "query_pre_attn_scalar": 12,
          "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
          "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "rope_local_base_freq": 100.0}
PROMPTS = [list(range(3, 33)), [7, 90, 11, 5, 64, 23, 41, 100, 2, 77, 19, 8, 55]]  # 30, 13
NEW_TOKENS = 12  # the 13-token prompt's decodes cross positions the window drops


def _with_tokenizer(folder: Path, tiny_llama_dir: Path) -> Path:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_llama_dir / name, folder / name)
    return folder


def _multimodal(folder: Path) -> Path:
    """A tiny Gemma3ForConditionalGeneration (a SigLIP tower, a projector) as saved."""
    text = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 128,
            "max_position_embeddings": 256, **GEMMA3}
    vision = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
              "num_attention_heads": 2, "image_size": 28, "patch_size": 14}
    config = transformers.Gemma3Config(text_config=text, vision_config=vision,
                                       mm_tokens_per_image=4, image_token_index=127,
                                       boi_token_index=125, eoi_token_index=126)
    torch.manual_seed(0)
    transformers.Gemma3ForConditionalGeneration(config).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory, make_model_dir) -> dict[str, Path]:
    root, tokenizer = tmp_path_factory.mktemp("gemma"), make_model_dir("tiny-llama")
    saved = {"gemma3": save_tiny("gemma3", root / "gemma3", **GEMMA3),
             "gemma": save_tiny("gemma", root / "gemma", hidden_act="gelu"),
             "gemma3-mm": _multimodal(root / "gemma3-mm")}
    return {name: _with_tokenizer(folder, tokenizer) for name, folder in saved.items()}


def _reference(folder: Path, prompt: list[int]) -> tuple[list[int], list[float], list[float]]:
    """transformers' greedy tokens, each one's logprob, and each prompt token's logprob."""
    multimodal = folder.name.endswith("-mm")
    model = (transformers.Gemma3ForConditionalGeneration if multimodal
             else transformers.AutoModelForCausalLM)
    model = model.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                             do_sample=False, output_logits=True, return_dict_in_generate=True)
        prompt_logits = model(ids).logits[0].log_softmax(-1)
    tokens = out.sequences[0, len(prompt):].tolist()
    logprobs = [step[0].log_softmax(-1)[t].item() for step, t in zip(out.logits, tokens, strict=True)]
    scored = [prompt_logits[i, t].item() for i, t in enumerate(prompt[1:])]
    return tokens, logprobs, scored


@pytest.mark.parametrize("name", ["gemma3", "gemma3-mm", "gemma"])
def test_tokens_and_logprobs_equal_transformers_in_chunks_across_the_window(folders, name):
    folder = folders[name]
    # 8-token steps: the 30-token prompt in four chunks, each reading the cache of the last.
    llm = LLM(str(folder), device="cpu", dtype="float32", max_model_len=128,
              max_num_batched_tokens=8, max_num_seqs=2)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, logprobs=0, prompt_logprobs=0)
    worst = 0.0
    for prompt, out in zip(PROMPTS, llm.generate(PROMPTS, params), strict=True):
        tokens, logprobs, scored = _reference(folder, prompt)
        assert out.outputs[0].token_ids == tokens, f"prompt of {len(prompt)}"
        ours = [step.logprob for step in out.outputs[0].logprobs]
        ours_scored = [p.logprob for p in out.prompt_logprobs[1:]]
        worst = max(worst, *(abs(a - b) for a, b in zip(ours + ours_scored,
                                                       logprobs + scored, strict=True)))
    assert worst < 1e-4


def test_the_window_and_the_second_rope_change_the_tokens(folders, tmp_path):
    """The equality above is not the window's or the local RoPE's by chance: served with
    either left out, Gemma 3's tokens differ."""
    expected, _, _ = _reference(folders["gemma3"], PROMPTS[0])
    for change in ({"sliding_window": 4096}, {"rope_local_base_freq": 1_000_000.0}):
        folder = shutil.copytree(folders["gemma3"], tmp_path / next(iter(change)))
        config = json.loads((folder / "config.json").read_text())
        if "rope_local_base_freq" in change:
            config["rope_parameters"]["sliding_attention"]["rope_theta"] = 1_000_000.0
        else:
            config.update(change)
        (folder / "config.json").write_text(json.dumps(config))
        llm = LLM(str(folder), device="cpu", dtype="float32", max_model_len=128)
        [out] = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=NEW_TOKENS))
        assert out.outputs[0].token_ids != expected, change


@pytest.mark.parametrize("name", ["gemma3", "gemma3-mm", "gemma"])
def test_the_plan_counts_what_the_engine_loads_and_keeps_every_layers_context(folders, name,
                                                                             capsys):
    folder = folders[name]
    config = ModelConfig.from_dir(folder)
    for dtype, dtype_name in ((torch.float32, "float32"), (torch.bfloat16, "bfloat16")):
        model = load_model(folder, config, dtype, torch.device("cpu"))
        assert weights_bytes(model) == loaded_weight_bytes(read_weights(folder), dtype_name)
    with torch.device("meta"):
        model = model_class(config)(config)
    assert tensor_names(config) == set(model.state_dict())
    assert float_shapes(config) == {n: tuple(t.shape) for n, t in model.state_dict().items()}
    assert main(["plan", str(folder), "--device", "cpu", "--json", "--max-model-len", "128"]) == 0
    kv = json.loads(capsys.readouterr().out)["kv"]
    assert kv["rule"] == ENGINE_RULE
    if name != "gemma":
        assert "sliding_window 8 on 2 of 3 layers saves no memory here" in kv["note"]


def test_the_vision_tower_is_neither_loaded_nor_counted(folders):
    weights = read_weights(folders["gemma3-mm"])
    assert all(t.name.startswith(("model.", "lm_head.")) for t in weights.tensors)
    assert any("vision_tower" in s and "not loaded" in s for s in weights.skipped)
    config = loadable_config(json.loads((folders["gemma3-mm"] / "config.json").read_text()),
                             weights.tensors)
    assert config.architecture == "Gemma3ForConditionalGeneration"


@pytest.mark.parametrize("change, message", [
    ({"architectures": ["Gemma2ForCausalLM"]}, "Gemma 2's attention logit softcapping"),
    ({"attn_logit_softcapping": 50.0}, "logit softcapping is not implemented"),
    ({"final_logit_softcapping": 30.0}, "logit softcapping is not implemented"),
    ({"hidden_activation": "silu"}, "hidden_activation 'silu'"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({"rope_parameters": {"full_attention": {"rope_type": "default"},
                          "sliding_attention": {"rope_type": "linear", "factor": 2.0}}},
     "sliding layers' rope_type 'linear'"),
])
def test_what_kvledgers_gemma_does_not_run_is_refused_in_one_line(folders, change, message):
    raw = {**json.loads((folders["gemma3"] / "config.json").read_text()), **change}
    with pytest.raises(BadInput, match=message):
        ModelConfig.from_dict(raw)


def test_gemma_over_several_gpus_is_refused_in_one_line(folders, capsys):
    assert main(["plan", str(folders["gemma3"]), "--device", "cpu",
                 "--tensor-parallel-size", "2"]) == 2
    assert "runs Gemma on one GPU, in one stage" in capsys.readouterr().err


def test_the_paged_path_reads_each_layers_window_in_place(folders, monkeypatch):
    """``--attention-backend TRITON_ATTN`` (the GPU's path, here under Triton's interpreter):
    the later chunks and the decodes read the pool in place, the sliding layers through
    their window; the tokens are transformers' still."""
    pytest.importorskip("triton")
    from kvledger.engine.model import attention

    def no_gather(*args, **kwargs):
        raise AssertionError("the paged path gathered blocks out of the pool")

    monkeypatch.setattr(attention, "_gather", no_gather)
    llm = LLM(str(folders["gemma3"]), device="cpu", dtype="float32", max_model_len=128,
              max_num_batched_tokens=8, max_num_seqs=2, attention_backend="TRITON_ATTN")
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=NEW_TOKENS))
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        assert out.outputs[0].token_ids == _reference(folders["gemma3"], prompt)[0]


def test_a_lora_adapter_on_every_projection_gives_transformers_peft_tokens(folders, tmp_path):
    pytest.importorskip("peft")
    from _lora_helpers import peft_greedy, write_adapter

    from kvledger.engine import LoRARequest

    adapter = write_adapter(tmp_path / "adapter", folders["gemma3"], rank=4, alpha=8, scale=1.0)
    llm = LLM(str(folders["gemma3"]), device="cpu", dtype="float32", max_model_len=128,
              enable_lora=True)
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=NEW_TOKENS),
                           lora_request=LoRARequest("a", 1, str(adapter)))
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        expected = peft_greedy(folders["gemma3"], adapter, prompt, NEW_TOKENS)
        assert out.outputs[0].token_ids == expected
        assert expected != _reference(folders["gemma3"], prompt)[0]  # the adapter matters
