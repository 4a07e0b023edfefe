"""Built-in checkpoints (make-model), the tokenizer, and loading: deterministic bytes,
sharded files, dtypes, and measured weight bytes equal to the planner's prediction."""

from __future__ import annotations

import hashlib
import json
import re

import pytest
import torch

from kvledger.engine.checkpoint.contents import read_weights
from kvledger.engine.checkpoint.loadable import loaded_names, tensor_names
from kvledger.engine.checkpoint.model_config import ModelConfig
from kvledger.engine.checkpoint.tensor_shapes import float_shapes
from kvledger.engine.cli import main as cli_main
from kvledger.engine.errors import BadInput
from kvledger.engine.model.builtin import MODELS
from kvledger.engine.model.loader import load_model, weights_bytes
from kvledger.engine.model.tokenizer import Tokenizer
from kvledger.engine.planner.plan import loaded_weight_bytes


def _digests(model_dir):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(model_dir.iterdir())}


def test_make_model_writes_the_same_bytes_every_time(tmp_path, tiny_llama_dir):
    import os
    import subprocess
    import sys

    # Another process with another hash seed: nothing may depend on set or dict order.
    subprocess.run([sys.executable, "-m", "kvledger.engine.cli", "make-model", "tiny-llama",
                    str(tmp_path / "again")], check=True, capture_output=True, timeout=120,
                   env={**os.environ, "PYTHONHASHSEED": "12345"})
    again = tmp_path / "again"
    assert _digests(again) == _digests(tiny_llama_dir)
    assert set(_digests(again)) == {"config.json", "generation_config.json", "model.safetensors",
                                    "tokenizer.json", "tokenizer_config.json"}
    assert (again / "model.safetensors").stat().st_size < 8 * 2**20


@pytest.mark.parametrize("name", ["tiny-qwen3", "tiny-mixtral", "tiny-qwen3-moe"])
def test_the_new_shapes_are_deterministic_and_small(tmp_path, make_model_dir, name):
    from kvledger.engine.model.builtin import write_model

    assert _digests(write_model(name, tmp_path / name)) == _digests(make_model_dir(name))
    assert (tmp_path / name / "model.safetensors").stat().st_size < 5 * 2**20


def test_make_model_cli(tmp_path, capsys):
    assert cli_main(["make-model", "tiny-qwen2", str(tmp_path / "q")]) == 0
    assert (tmp_path / "q" / "model.safetensors").is_file()
    assert cli_main(["make-model", "gpt-17", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "unknown built-in model 'gpt-17'" in err and "tiny-llama" in err and "Traceback" not in err


def _copy(src, dst):
    dst.mkdir()
    for p in src.iterdir():
        (dst / p.name).write_bytes(p.read_bytes())
    return dst


def _hidden(folder):
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


def test_make_model_is_a_no_op_when_the_same_checkpoint_is_there(tmp_path, tiny_llama_dir, capsys):
    out = _copy(tiny_llama_dir, tmp_path / "m")
    before = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in out.iterdir()}
    assert cli_main(["make-model", "tiny-llama", str(out)]) == 0
    assert f"tiny-llama is already in {out} (the same bytes); nothing written" in capsys.readouterr().out
    assert {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in out.iterdir()} == before


def test_make_model_fills_an_empty_folder_with_readable_modes_whatever_the_umask(tmp_path, capsys):
    import os

    out = tmp_path / "empty"
    out.mkdir()
    old_umask = os.umask(0o077)
    try:
        assert cli_main(["make-model", "tiny-llama", str(out)]) == 0
    finally:
        os.umask(old_umask)
    assert out.stat().st_mode & 0o777 == 0o755
    assert {p.stat().st_mode & 0o777 for p in out.iterdir()} == {0o644}
    assert len(list(out.iterdir())) == 5 and _hidden(tmp_path) == []


def test_make_model_refuses_a_folder_holding_anything_else_and_force_replaces_it(
        tmp_path, tiny_llama_dir, capsys):
    out = _copy(tiny_llama_dir, tmp_path / "m")
    (out / "config.json").write_text("{}")
    (out / "tokenizer.json").unlink()
    (out / "notes.txt").write_text("mine")
    assert cli_main(["make-model", "tiny-llama", str(out)]) == 2
    err = capsys.readouterr().err
    assert err == (f"error: {out} holds something other than tiny-llama (config.json differs; "
                   "missing tokenizer.json; other files: notes.txt); nothing written "
                   "(--force replaces it)\n")
    assert (out / "config.json").read_text() == "{}" and (out / "notes.txt").exists()
    assert _hidden(tmp_path) == []

    assert cli_main(["make-model", "tiny-llama", str(out), "--force"]) == 0
    assert _digests(out) == _digests(tiny_llama_dir) and _hidden(tmp_path) == []


def test_make_model_refuses_a_file_even_with_force(tmp_path, capsys):
    (tmp_path / "f").write_text("x")
    assert cli_main(["make-model", "tiny-llama", str(tmp_path / "f"), "--force"]) == 2
    assert capsys.readouterr().err == f"error: {tmp_path / 'f'} exists and is not a directory; nothing written\n"


def test_make_model_refuses_a_name_too_long_in_one_line(tmp_path, capsys):
    """A folder name past the file system's 255 bytes: an OSError traceback before."""
    assert cli_main(["make-model", "tiny-llama", str(tmp_path / ("m" * 300))]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: cannot write tiny-llama to ") and err.count("\n") == 1, err
    assert "File name too long" in err and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("existing", [False, True])
def test_an_interrupted_make_model_leaves_no_half_written_folder(tmp_path, tiny_llama_dir,
                                                                 monkeypatch, existing):
    from kvledger.engine.model import builtin as make_model

    def interrupted(config, path, *, seed):
        path.write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(make_model, "write_weights", interrupted)
    out = tmp_path / "m"
    if existing:
        _copy(tiny_llama_dir, out)
        (out / "notes.txt").write_text("mine")
    with pytest.raises(KeyboardInterrupt):
        make_model.write_model("tiny-llama", out, force=True)
    assert _hidden(tmp_path) == []
    if existing:  # --force removes the old contents only once the new checkpoint is complete
        assert (out / "notes.txt").read_text() == "mine"
    else:
        assert not out.exists()


def test_a_failed_swap_puts_the_old_checkpoint_back(tmp_path, tiny_llama_dir, monkeypatch):
    import os

    from kvledger.engine.model import builtin as make_model

    out = _copy(tiny_llama_dir, tmp_path / "m")
    (out / "notes.txt").write_text("mine")
    real_rename = os.rename

    def rename(src, dst):
        if str(src).endswith(".partial"):
            raise OSError(28, "No space left on device")
        real_rename(src, dst)

    monkeypatch.setattr(make_model.os, "rename", rename)
    with pytest.raises(BadInput, match=f"cannot write tiny-llama to {out}: No space left"):
        make_model.write_model("tiny-llama", out, force=True)
    assert (out / "notes.txt").read_text() == "mine" and _hidden(tmp_path) == []


@pytest.mark.parametrize("name", list(MODELS))
def test_measured_weight_bytes_equal_the_planner_prediction(make_model_dir, name):
    model_dir = make_model_dir(name)
    config = ModelConfig.from_dir(model_dir)
    for dtype, dtype_name in ((torch.float32, "float32"), (torch.bfloat16, "bfloat16")):
        model = load_model(model_dir, config, dtype, torch.device("cpu"))
        predicted = loaded_weight_bytes(read_weights(model_dir), dtype_name)
        assert weights_bytes(model) == predicted


def test_sharded_checkpoint_loads_the_same_tensors(tiny_llama_dir, sharded_tiny_llama_dir):
    sharded = sharded_tiny_llama_dir
    assert sorted(p.name for p in sharded.glob("*.safetensors")) == [
        "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    config = ModelConfig.from_dir(sharded)
    one = load_model(tiny_llama_dir, config, torch.float32, torch.device("cpu")).state_dict()
    two = load_model(sharded, config, torch.float32, torch.device("cpu")).state_dict()
    assert one.keys() == two.keys() and all(torch.equal(one[k], two[k]) for k in one)


def test_a_checkpoint_missing_a_tensor_is_refused(tmp_path, tiny_llama_dir):
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(tiny_llama_dir / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_bytes((tiny_llama_dir / "config.json").read_bytes())
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(BadInput, match=r"missing .*up_proj"):
        load_model(broken, ModelConfig.from_dir(broken), torch.float32, torch.device("cpu"))


def test_experts_saved_fused_by_transformers_load_the_same(tmp_path, make_model_dir):
    """transformers 5 keeps experts fused in 3D tensors and saves them per expert, as
    published, unless told otherwise (``save_original_format=False``): both load."""
    transformers = pytest.importorskip("transformers")
    for name in ("tiny-mixtral", "tiny-qwen3-moe"):
        source = make_model_dir(name)
        config = ModelConfig.from_dir(source)
        ours = load_model(source, config, torch.float32, torch.device("cpu")).state_dict()
        hf = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
        for original_format in (True, False):
            saved = tmp_path / f"{name}-{original_format}"
            hf.save_pretrained(saved, save_original_format=original_format)
            model = load_model(saved, config, torch.float32, torch.device("cpu"))
            loaded = model.state_dict()
            assert loaded.keys() == ours.keys() and all(torch.equal(loaded[k], ours[k]) for k in ours)
            assert weights_bytes(model) == loaded_weight_bytes(read_weights(saved), "float32")


@pytest.mark.parametrize("change", [{}, {"attention_bias": True}, {"tie_word_embeddings": True}])
@pytest.mark.parametrize("name", list(MODELS))
def test_the_names_and_shapes_the_preflight_checks_are_the_models(make_model_dir, name, change):
    """``tensor_names`` and ``float_shapes`` (torch-free, what the pre-flight checks a
    checkpoint's headers against) are the state dict of the model the loader fills, names
    and shapes, for every built-in shape and its biased and tied variants."""
    from kvledger.engine.model.transformer import CausalLM

    raw = {**json.loads((make_model_dir(name) / "config.json").read_text()), **change}
    config = ModelConfig.from_dict(raw)
    with torch.device("meta"):
        model = CausalLM(config)
    assert tensor_names(config) == set(model.state_dict())
    assert float_shapes(config) == {n: tuple(t.shape) for n, t in model.state_dict().items()}


def test_fused_experts_are_named_as_the_loader_splits_them(make_model_dir):
    config = ModelConfig.from_dir(make_model_dir("tiny-mixtral"))
    experts = config.moe.num_experts
    assert loaded_names("model.layers.1.mlp.experts.gate_up_proj", (experts, 8, 4), config) == \
        tuple(f"model.layers.1.block_sparse_moe.experts.{e}.{p}.weight"
              for e in range(experts) for p in ("w1", "w3"))
    assert loaded_names("model.layers.1.mlp.experts.down_proj", (experts, 4, 4), config)[-1] == \
        f"model.layers.1.block_sparse_moe.experts.{experts - 1}.w2.weight"
    assert loaded_names("model.layers.1.mlp.gate.weight", (experts, 4), config) == \
        ("model.layers.1.block_sparse_moe.gate.weight",)
    # Not 3-D: not fused, and not a name the engine has (the pre-flight refuses it).
    assert loaded_names("model.layers.1.mlp.experts.down_proj", (4, 4), config) == \
        ("model.layers.1.mlp.experts.down_proj",)


@pytest.mark.parametrize("change, message", [
    ({"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe",
      "shared_expert_intermediate_size": 64}, "unsupported architecture Qwen2MoeForCausalLM"),
    ({"shared_expert_intermediate_size": 64}, "unsupported: a shared expert"),
    ({"scoring_func": "sigmoid"}, "unsupported MoE router: scoring_func 'sigmoid'"),
])
def test_preflight_refuses_an_unsupported_moe_in_one_line(tmp_path, make_model_dir, capsys,
                                                          change, message):
    """Exit 2 before the pod's engine starts (the planner may name the architecture first)."""
    model = _copy(make_model_dir("tiny-qwen3-moe"), tmp_path / "moe")
    raw = {**json.loads((model / "config.json").read_text()), **change}
    (model / "config.json").write_text(json.dumps(raw))
    code = cli_main(["preflight", "--model", str(model), "--device", "cpu", "--max-model-len", "256",
                     "--termination-log", str(tmp_path / "log")])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(f"error: {message}") and err.count("\n") == 1, err


def test_tokenizer_round_trip_chat_template_and_streaming(tiny_llama_dir):
    tok = Tokenizer(tiny_llama_dir)
    text = "Hello, world! The ledger — naïve café 日本語 🙂"
    ids = tok.encode(text)
    assert ids[0] == tok.token_to_id("<s>") and tok.decode(ids) == text
    assert tok.encode(text, add_special_tokens=False) == ids[1:]
    assert tok.vocab_size == json.loads((tiny_llama_dir / "config.json").read_text())["vocab_size"]
    assert tok.eos_token_ids == {tok.token_to_id("</s>"), tok.token_to_id("<|end|>")}

    prompt = tok.apply_chat_template([{"role": "system", "content": "Be brief."},
                                      {"role": "user", "content": "Hi"}])
    assert prompt == "<s><|system|>\nBe brief.<|end|>\n<|user|>\nHi<|end|>\n<|assistant|>\n"
    with pytest.raises(BadInput, match="unknown role"):
        tok.apply_chat_template([{"role": "wizard", "content": "x"}])

    detok = tok.detokenizer(ids[:4])
    pieces = [detok.add(i) for i in ids[4:]]
    assert "".join(pieces) == detok.text == tok.decode(ids[4:])
    assert all("\ufffd" not in p for p in pieces)  # never half a character


def test_spaces_between_special_tokens_as_vllm_streams_them(tmp_path):
    """vLLM's ``spaces_between_special_tokens`` false (with ``skip_special_tokens`` false):
    a decoder that spaces tokens apart (WordPiece's) spaces an added token from the text
    before it, never from the added token before it; true (the default) leaves the
    decoder's text. The expected pieces are vLLM 0.32's fast detokenizer's."""
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    hf = HFTokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    hf.pre_tokenizer, hf.decoder = pre_tokenizers.Whitespace(), decoders.WordPiece()
    hf.add_special_tokens([AddedToken("<a>", special=True), AddedToken("<b>", special=True)])
    hf.add_tokens([AddedToken("<c>", special=False)])
    hf.save(str(tmp_path / "tokenizer.json"))
    tok = Tokenizer(tmp_path)
    assert tok.added_texts == {3: "<a>", 4: "<b>", 5: "<c>"}

    def pieces(**flags):
        detok = tok.detokenizer([1], **flags)
        return [detok.add(token_id) for token_id in (3, 4, 5, 2, 3)]

    assert pieces(skip_special_tokens=False) == [" <a>", " <b>", " <c>", " world", " <a>"]
    assert pieces(skip_special_tokens=False, spaces_between_special_tokens=False) == [
        " <a>", "<b>", "<c>", " world", " <a>"]
    # skipping special tokens, the flag changes nothing (as in vLLM)
    assert pieces(spaces_between_special_tokens=False) == pieces() == ["", "", " <c>",
                                                                       " world", ""]


def test_chat_template_matches_transformers(tiny_llama_dir):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    messages = [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "4"},
                {"role": "user", "content": "And 3 + 3?"}]
    ours = Tokenizer(tiny_llama_dir)
    assert ours.apply_chat_template(messages) == hf.apply_chat_template(messages, tokenize=False,
                                                                        add_generation_prompt=True)
    assert ours.encode("Tell me about the weather.") == hf("Tell me about the weather.")["input_ids"]


@pytest.mark.parametrize("flags, weight_dtype, kv_dtype", [
    ({"dtype": "bfloat16"}, torch.bfloat16, torch.bfloat16),
    ({"kv_cache_dtype": "fp8"}, torch.float32, torch.float8_e4m3fn),
])
def test_dtype_flags_reach_the_weights_and_the_kv_pool(tiny_llama_dir, flags, weight_dtype, kv_dtype):
    from kvledger.engine import LLM, SamplingParams

    llm = LLM(str(tiny_llama_dir), max_model_len=64, max_num_seqs=2, device="cpu", **flags)
    runner = llm.engine.runner
    weights = {t.dtype for t in (*runner.model.parameters(), *runner.model.buffers())
               if t.dim() == 2}  # on the CPU the linear layers hold packed buffers
    assert weights == {weight_dtype} and runner.kv_cache.dtype == kv_dtype
    assert llm.engine.plan.classes["kv_cache"] == runner.kv_cache.numel() * runner.kv_cache.element_size()
    out = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    assert len(out[0].token_ids) == 10


@pytest.mark.parametrize(("bfloat16", "expected"), [(True, torch.bfloat16), (False, torch.float16)])
def test_a_float32_checkpoint_loads_in_half_precision_on_a_gpu(tiny_llama_dir, monkeypatch,
                                                              bfloat16, expected):
    """--dtype auto on a GPU (here its probe, the CPU standing in for its memory): the
    engine loads the float32 built-in in the plan's half precision, as vLLM would run it."""
    from kvledger.engine import LLM
    from kvledger.engine.core import startup
    from kvledger.engine.planner.device import DeviceMemory

    gpu = DeviceMemory("cuda", "a GPU", 80 * 2**30, 79 * 2**30, False, bfloat16)
    monkeypatch.setattr(startup, "probe_device", lambda config: gpu)
    llm = LLM(str(tiny_llama_dir), max_model_len=64, max_num_seqs=2, device="cpu")
    runner = llm.engine.runner
    assert {t.dtype for t in runner.model.parameters()} == {expected}
    assert runner.kv_cache.dtype == expected
    assert llm.engine.plan.model_dtype == str(expected).removeprefix("torch.")


def test_missing_files_are_one_line_bad_input(tmp_path, tiny_llama_dir):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(BadInput, match=r"no config\.json"):
        ModelConfig.from_dir(empty)
    with pytest.raises(BadInput, match=r"no tokenizer\.json"):
        Tokenizer(empty)
    (empty / "config.json").write_text("{not json")
    with pytest.raises(BadInput, match="not valid JSON"):
        ModelConfig.from_dir(empty)
    with pytest.raises(BadInput, match=r"default chat template is no longer allowed.*This "
                                       "model has none"):
        no_template = tmp_path / "no-template"
        no_template.mkdir()
        (no_template / "tokenizer.json").write_bytes((tiny_llama_dir / "tokenizer.json").read_bytes())
        Tokenizer(no_template).apply_chat_template([{"role": "user", "content": "hi"}])


@pytest.mark.parametrize("template, message", [
    (5, "chat_template must be a string, got int"),
    ([{"name": "default"}], "must be a string or a list of {name, template} objects"),
    ("{% for m in messages %}{{ m.content }}", "is not a valid jinja2 template: Unexpected end"),
    ("{{ messages | nofilter }}", "is not a valid jinja2 template: No filter named 'nofilter'"),
])
def test_a_broken_chat_template_is_refused_at_load(tmp_path, tiny_llama_dir, template, message):
    model = tmp_path / "model"
    model.mkdir()
    (model / "tokenizer.json").write_bytes((tiny_llama_dir / "tokenizer.json").read_bytes())
    (model / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    with pytest.raises(BadInput, match=re.escape(message)):
        Tokenizer(model)


@pytest.mark.parametrize("name", ["tokenizer_config.json", "generation_config.json"])
def test_a_side_file_that_is_not_a_json_object_is_bad_input(tmp_path, tiny_llama_dir, name):
    model = tmp_path / "model"
    model.mkdir()
    (model / "tokenizer.json").write_bytes((tiny_llama_dir / "tokenizer.json").read_bytes())
    (model / name).write_text("[1]")
    with pytest.raises(BadInput, match=re.escape(f"{name}: must be a JSON object, got list")):
        Tokenizer(model)


def test_the_detokenizer_keeps_only_the_special_tokens_it_is_told(tiny_llama_dir):
    """A tool parser's markers (``kept_special_ids``) stay in the text where they come;
    every other special token is dropped, and the text around them decodes as before."""
    tok = Tokenizer(tiny_llama_dir)
    end, eos = tok.special_token_id("<|end|>"), tok.special_token_id("</s>")
    assert tok.special_token_id("hello") is None and end is not None
    words = tok.encode("The weather is mild. é", add_special_tokens=False)
    ids = [*words[:3], end, *words[3:], eos]
    for kept, shown in ((frozenset({end}), "<|end|>"), (frozenset(), "")):
        detok = tok.detokenizer(tok.encode("Hi"), kept)
        text = "".join(detok.add(i) for i in ids)
        assert text == tok.decode(words[:3]) + shown + tok.decode(words[3:])
        assert "</s>" not in text


def test_a_kept_marker_never_reorders_the_text_around_it(tiny_llama_dir):
    """A character's first bytes, then a kept marker: the bytes go out (as U+FFFD, as a
    decode of the whole output gives them) before the marker, not after it, where a tool
    parser looking for text right after ``<tool_call>`` would find them."""
    tok = Tokenizer(tiny_llama_dir)
    end = tok.special_token_id("<|end|>")
    head, *rest = tok.encode("é", add_special_tokens=False)
    assert rest, "é is more than one byte token here"
    sky = tok.encode(" sky", add_special_tokens=False)
    ids = [*tok.encode("Hi", add_special_tokens=False), head, end, *rest, *sky]
    detok = tok.detokenizer(tok.encode("Hi"), frozenset({end}))
    pieces = [detok.add(i) for i in ids]
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=False)
    assert pieces[ids.index(end)].endswith("\ufffd<|end|>")
