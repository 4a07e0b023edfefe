"""What a checkpoint's tokenizer files say, read as transformers reads them (the reference,
loaded from the same folder): chat templates with jinja2's loop controls and
transformers' ``{% generation %}`` tag, the special tokens a template reads, the ids that
stop generation (generation_config.json's, else config.json's, as vLLM takes them), and
the vocabulary's strings."""

from __future__ import annotations

import json
import shutil

import pytest
from transformers import AutoTokenizer

from kvledger.engine.model.tokenizer import Tokenizer

TEMPLATES = {
    "break": ("{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
              "<|user|>{{ m['content'] }}<|end|>{% endfor %}"),
    "continue": ("{% for m in messages %}{% if m['role'] == 'system' %}{% continue %}"
                 "{% endif %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"),
    "generation": ("{% for m in messages %}{% if m['role'] == 'assistant' %}"
                   "{% generation %}<|assistant|>{{ m['content'] }}<|end|>{% endgeneration %}"
                   "{% else %}<|user|>{{ m['content'] }}<|end|>{% endif %}{% endfor %}"),
    "specials": "{{ bos_token }}[{{ pad_token }}][{{ unk_token }}]{{ messages[0]['content'] }}",
    # transformers 5 gives a template the named tokens only, whatever the config lists
    "extras": "[{{ additional_special_tokens }}][{{ extra_special_tokens }}]{{ messages[0]['content'] }}",
}
CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"}, {"role": "user", "content": "again"}]


@pytest.fixture
def model_dir(tiny_llama_dir, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.update(pad_token="<|end|>", unk_token="<|system|>",  # and transformers 4's key:
                  additional_special_tokens=["<|user|>", "<|assistant|>"])
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("name", TEMPLATES)
def test_a_template_renders_as_transformers_renders_it(model_dir, name):
    (model_dir / "chat_template.jinja").write_text(TEMPLATES[name])
    reference = AutoTokenizer.from_pretrained(model_dir)
    expected = reference.apply_chat_template(CHAT, tokenize=False)
    ours = Tokenizer(model_dir).apply_chat_template(CHAT, add_generation_prompt=False)
    assert ours == expected
    assert "hi" in ours or "be brief" in ours
    # Before: break, continue and generation were refused at start; pad_token rendered "".


def _write(folder, name: str, body: dict) -> None:
    (folder / name).write_text(json.dumps(body))


def test_the_ids_that_stop_are_generation_configs_else_configs(model_dir, tmp_path):
    tok = Tokenizer(model_dir)
    eos = tok.token_to_id("</s>")
    config = json.loads((model_dir / "config.json").read_text())
    _write(model_dir, "config.json", {**config, "eos_token_id": [eos, 7]})
    _write(model_dir, "generation_config.json", {"eos_token_id": [eos, 9]})
    assert Tokenizer(model_dir).eos_token_ids == {eos, 9}  # config.json's 7 does not stop
    assert Tokenizer(model_dir, "vllm").eos_token_ids == {eos, 9}  # only defaults dropped
    other = tmp_path / "other"
    other.mkdir()
    _write(other, "generation_config.json", {"eos_token_id": 11})
    assert Tokenizer(model_dir, str(other)).eos_token_ids == {eos, 11}
    (model_dir / "generation_config.json").unlink()
    assert Tokenizer(model_dir).eos_token_ids == {eos, 7}  # no file: config.json's


def test_the_vocabularys_strings_are_transformers(model_dir):
    reference = AutoTokenizer.from_pretrained(model_dir)
    tok = Tokenizer(model_dir)
    ids = tok.encode("Café 🙂 <|end|>")
    assert [tok.id_to_token(i) for i in ids] == reference.convert_ids_to_tokens(ids)
    assert tok.id_to_token(10**6) is None
