"""config.json as transformers 5 writes and reads it, read as vLLM 0.32 reads it: a
linear RoPE's factor widens the context (``config_numbers.context_length``, vLLM's
``_get_and_verify_max_len``), and ``dtype`` is read before the older ``torch_dtype``."""

from __future__ import annotations

import json
import shutil

import torch
from _tiny_models import save_tiny

from kvledger.engine import LLM, SamplingParams
from kvledger.engine.cli import main


def _with_tokenizer(folder, tiny_llama_dir):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_llama_dir / name, folder / name)
    return folder


def test_a_linear_ropes_factor_widens_the_context_as_transformers_runs_it(
        tmp_path, tiny_llama_dir, capsys):
    folder = _with_tokenizer(save_tiny(
        "llama", tmp_path / "linear", vocab_size=1024, max_position_embeddings=64,
        rope_scaling={"rope_type": "linear", "factor": 2.0}), tiny_llama_dir)
    assert "rope_parameters" in json.loads((folder / "config.json").read_text())
    assert main(["plan", str(folder), "--device", "cpu", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["max_model_len"] == 128  # was 64
    assert main(["plan", str(folder), "--device", "cpu", "--max-model-len", "129"]) == 2
    assert "128 positions the model takes" in capsys.readouterr().err
    # Greedy tokens past max_position_embeddings are transformers' own.
    import transformers

    reference = transformers.LlamaForCausalLM.from_pretrained(folder).eval()
    prompt = torch.randint(5, 1000, (1, 90), generator=torch.Generator().manual_seed(0))
    expected = reference.generate(prompt, max_new_tokens=20, do_sample=False)[0, 90:].tolist()
    llm = LLM(str(folder), device="cpu", dtype="float32")
    [out] = llm.generate([prompt[0].tolist()], SamplingParams(temperature=0, max_tokens=20))
    assert out.outputs[0].token_ids == expected


def test_dtype_is_read_before_torch_dtype(tmp_path, tiny_llama_dir, capsys):
    folder = save_tiny("llama", tmp_path / "both")
    config = json.loads((folder / "config.json").read_text())
    config.update(dtype="bfloat16", torch_dtype="float16")  # transformers 5 reads dtype
    (folder / "config.json").write_text(json.dumps(config))
    assert main(["plan", str(folder), "--device", "cpu", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["model_dtype"] == "bfloat16"  # was float16
