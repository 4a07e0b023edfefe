"""A checkpoint as transformers 5 saves it, served by hub id, chats as the same folder served
from disk does (issue 52): transformers 5 writes the chat templates to
``chat_template.jinja`` and ``additional_chat_templates/``, which the hub fetch once left
out, so every such model answered chat with 400 "no chat template". And the hub fetch
selects exactly the files the engine opens from a local folder (``checkpoint/files.py``
names them once), recorded with inotify as ``kvledger serve DIR`` loads."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from _file_opens import OpenRecorder
from _hub_helpers import hub_env, point_hub_at
from _server_helpers import free_port, reap, wait_for_serve
from hub_server import HubServer

from kvledger.engine.checkpoint.hub.repo import engine_files, list_repo, read_index
from kvledger.engine.checkpoint.hub.uri import parse_uri

transformers = pytest.importorskip("transformers")
openai = pytest.importorskip("openai")

REPO = "kvledger-test/t5-chat"
# OpenAI's developer role as a system turn, and a kwarg the request sets (Qwen 3's
# enable_thinking, as it reads it).
DEFAULT = ("{% for m in messages %}<|{{ 'system' if m['role'] == 'developer' else m['role'] }}|>"
           "\n{{ m['content'] }}<|end|>\n{% endfor %}"
           "{% if add_generation_prompt %}<|assistant|>\n"
           "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
           "{% endif %}{% endif %}")
TOOL_USE = ("<|system|>\ntools: {{ tools | length }}<|end|>\n"
            "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
# What a hub repo holds beside a checkpoint that the engine does not read.
UNREAD = {"README.md": "# t5-chat\n", "special_tokens_map.json": "{}",
          "original/params.json": "{}", "pytorch_model.bin": "not read"}


def save_t5_checkpoint(tokenizer_source: Path, out: Path, **save) -> Path:
    """A tiny random Llama and the built-in tokenizer with two chat templates, each saved
    by transformers 5's ``save_pretrained``, as a hub repo holds them."""
    import torch

    tok = transformers.AutoTokenizer.from_pretrained(str(tokenizer_source))
    tok.chat_template = {"default": DEFAULT, "tool_use": TOOL_USE}
    config = transformers.LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(str(out), **save)
    tok.save_pretrained(str(out))
    for name, text in UNREAD.items():
        (out / name).parent.mkdir(exist_ok=True)
        (out / name).write_text(text)
    return out


@pytest.fixture(scope="module")
def t5_checkpoint(tiny_llama_dir, tmp_path_factory) -> Path:
    out = save_t5_checkpoint(tiny_llama_dir, tmp_path_factory.mktemp("t5-chat"))
    assert (out / "chat_template.jinja").is_file()
    assert (out / "additional_chat_templates" / "tool_use.jinja").is_file()
    return out


def _serve(argv: list[str], env: dict[str, str] | None = None) -> tuple[subprocess.Popen, int]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "kvledger.engine.cli", "serve", *argv,
                             "--device", "cpu", "--max-model-len", "256", "--host",
                             "127.0.0.1", "--port", str(port)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_serve(proc, port)
    return proc, port


def _prompt_tokens(tok, messages: list[dict], **kwargs) -> int:
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                   **kwargs)
    return len(tok(text, add_special_tokens=False)["input_ids"])


def test_a_transformers_5_checkpoint_chats_by_bare_hub_id(t5_checkpoint, tmp_path) -> None:
    tok = transformers.AutoTokenizer.from_pretrained(str(t5_checkpoint))
    with HubServer() as hub:
        hub.add_commit(REPO, t5_checkpoint)
        proc, port = _serve([REPO], hub_env(hub.url, tmp_path / "home"))
        try:
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                                   max_retries=0)
            assert [m.id for m in client.models.list()] == [REPO]
            user = {"role": "user", "content": "Once upon"}
            chat = client.chat.completions.create(model=REPO, messages=[user], max_tokens=4)
            assert chat.usage.completion_tokens == 4
            assert chat.usage.prompt_tokens == _prompt_tokens(tok, [user])
            # A developer turn and chat_template_kwargs reach the template (the hub
            # copy's, read from chat_template.jinja) as transformers renders them.
            developer = [{"role": "developer", "content": "Be brief."}, user]
            counts = set()
            for thinking in (True, False):
                answer = client.chat.completions.create(
                    model=REPO, messages=developer, max_tokens=2,
                    extra_body={"chat_template_kwargs": {"enable_thinking": thinking}})
                assert answer.usage.prompt_tokens == _prompt_tokens(
                    tok, developer, enable_thinking=thinking), thinking
                counts.add(answer.usage.prompt_tokens)
            assert len(counts) == 2  # the kwarg changed the prompt
            # A request with tools takes additional_chat_templates/tool_use.jinja.
            tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
            with_tools = client.chat.completions.create(model=REPO, messages=[user],
                                                        tools=tools, tool_choice="none",
                                                        max_tokens=2)
            assert with_tools.usage.prompt_tokens == _prompt_tokens(tok, [user], tools=tools)
            assert with_tools.usage.prompt_tokens != chat.usage.prompt_tokens
        finally:
            reap(proc)


def test_the_hub_fetch_selects_the_files_the_engine_opens_from_a_folder(
        tiny_llama_dir, tmp_path, monkeypatch) -> None:
    # Sharded (an index and its shards), with what the engine does not read beside it.
    folder = save_t5_checkpoint(tiny_llama_dir, tmp_path / "sharded", max_shard_size="100KB")
    assert (folder / "model.safetensors.index.json").is_file()
    with OpenRecorder(folder) as opens:
        proc, _ = _serve([str(folder)])
        reap(proc)
        read = opens.files()
    assert {"chat_template.jinja", "additional_chat_templates/tool_use.jinja",
            "model.safetensors.index.json"} <= read
    assert not read & set(UNREAD), read
    with HubServer() as hub:
        hub.add_commit(REPO, folder)
        point_hub_at(monkeypatch, hub.url, tmp_path)
        listing = list_repo(parse_uri("hf://" + REPO))
        fetched = set(engine_files(listing, read_index(listing)))
    assert fetched == read
    shutil.rmtree(folder)
