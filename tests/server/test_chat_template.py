"""Chat templates as today's checkpoints ship them and as vLLM's users pass them: the
template files transformers 5's ``save_pretrained`` writes (``chat_template.jinja``,
``additional_chat_templates/``), vLLM's ``--chat-template FILE|TEMPLATE``,
``--trust-request-chat-template`` and ``--default-chat-template-kwargs``, and the request
fields ``chat_template``, ``chat_template_kwargs``, ``add_generation_prompt`` and
``continue_final_message``; OpenAI's ``developer`` role."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from _server_helpers import make_llm, model_name, start_app

from kvledger.engine import cli
from kvledger.engine.errors import BadInput
from kvledger.engine.model import chat_template
from kvledger.engine.model.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

THINKING = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>\n"
            "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}"
            "{% endif %}")
TOOL_USE = ("{{ bos_token }}<|system|>\ntools: {{ tools | length }}<|end|>\n"
            "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
CHAT = [{"role": "user", "content": "Once upon"}]


def _saved_by_transformers(source: Path, out: Path, templates: str | dict[str, str]) -> Path:
    """``source``'s checkpoint with its tokenizer saved again by transformers 5, holding
    ``templates``: the files it writes, not tokenizer_config.json's key."""
    for name in ("config.json", "model.safetensors", "generation_config.json"):
        shutil.copy(source / name, out / name)
    tok = transformers.AutoTokenizer.from_pretrained(str(source))
    tok.chat_template = templates
    tok.save_pretrained(str(out))
    assert "chat_template" not in json.loads((out / "tokenizer_config.json").read_text())
    return out


@pytest.fixture(scope="module")
def t5_dir(tiny_llama_dir, tmp_path_factory) -> Path:
    builtin = Tokenizer(tiny_llama_dir).chat_template
    return _saved_by_transformers(tiny_llama_dir, tmp_path_factory.mktemp("t5"), builtin)


@pytest.fixture(scope="module")
def t5_llm(t5_dir):
    return make_llm(t5_dir)


def test_transformers_5_template_files_are_read_as_transformers_reads_them(tiny_llama_dir,
                                                                           t5_dir, tmp_path):
    assert (t5_dir / "chat_template.jinja").is_file()
    ours, hf = Tokenizer(t5_dir), transformers.AutoTokenizer.from_pretrained(str(t5_dir))
    assert ours.chat_template == hf.chat_template == Tokenizer(tiny_llama_dir).chat_template
    assert ours.apply_chat_template(CHAT) == hf.apply_chat_template(
        CHAT, tokenize=False, add_generation_prompt=True)
    # Several: the default as chat_template.jinja, the others in additional_chat_templates/; a
    # request with tools takes tool_use, as transformers does.
    many = _saved_by_transformers(tiny_llama_dir, tmp_path,
                                  {"default": THINKING, "tool_use": TOOL_USE})
    assert (many / "additional_chat_templates" / "tool_use.jinja").is_file()
    tok, hf = Tokenizer(many), transformers.AutoTokenizer.from_pretrained(str(many))
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    for given in (None, tools):
        assert tok.apply_chat_template(CHAT, tools=given) == hf.apply_chat_template(
            CHAT, tools=given, tokenize=False, add_generation_prompt=True)
    assert tok.apply_chat_template(CHAT, tools=tools).startswith("<s><|system|>\ntools: 1")


def test_a_broken_template_file_is_refused_at_load(tiny_llama_dir, tmp_path):
    broken = _saved_by_transformers(tiny_llama_dir, tmp_path, "{% for m in messages %}")
    with pytest.raises(BadInput, match="chat template 'default': the chat template is not a "
                                       "valid jinja2 template"):
        Tokenizer(broken)


async def test_chat_serves_a_transformers_5_checkpoint(aiohttp_client, t5_llm):
    client = await start_app(aiohttp_client, t5_llm)
    response = await client.post("/v1/chat/completions", json={
        "model": model_name(client), "messages": CHAT, "max_tokens": 3})
    assert response.status == 200, await response.text()
    assert (await response.json())["usage"]["completion_tokens"] == 3


async def _tokens(client, **body) -> tuple[int, dict]:
    response = await client.post("/tokenize", json={"messages": CHAT, **body})
    return response.status, await response.json()


async def test_request_fields_render_as_vllm_renders_them(aiohttp_client, t5_llm):
    client = await start_app(aiohttp_client, t5_llm, trust_request_chat_template=True,
                             default_chat_template_kwargs={"enable_thinking": True})
    tok = t5_llm.tokenizer

    def ids(text):
        return tok.encode(text, add_special_tokens=False)

    status, body = await _tokens(client, chat_template=THINKING)
    assert status == 200 and body["tokens"] == ids("<|user|>\nOnce upon<|end|>\n<|assistant|>\n")
    # chat_template_kwargs over the server's defaults; names the template does not read dropped
    status, body = await _tokens(client, chat_template=THINKING,
                                 chat_template_kwargs={"enable_thinking": False, "unused": 1})
    assert body["tokens"] == ids("<|user|>\nOnce upon<|end|>\n<|assistant|>\n<think></think>")
    status, body = await _tokens(client, add_generation_prompt=False)
    assert body["tokens"] == ids("<s><|user|>\nOnce upon<|end|>\n")
    # the last message left open for the model to continue: the template's close cut off
    prefill = [*CHAT, {"role": "assistant", "content": "there was "}]
    status, body = await _tokens(client, messages=prefill, continue_final_message=True)
    assert body["tokens"] == ids("<s><|user|>\nOnce upon<|end|>\n<|assistant|>\nthere was")
    response = await client.post("/v1/chat/completions", json={
        "model": model_name(client), "messages": prefill, "continue_final_message": True,
        "max_tokens": 2})
    assert response.status == 200, await response.text()
    for body, param in (({"continue_final_message": True, "add_generation_prompt": True},
                         "continue_final_message"),
                        ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
                        ({"chat_template": "{% if %}"}, "chat_template"),
                        ({"chat_template": "{{ 'x' }}", "continue_final_message": True},
                         "messages")):
        status, answer = await _tokens(client, **body)
        assert status == 400 and answer["error"]["param"] == param, answer


async def test_a_request_template_needs_the_servers_trust(aiohttp_client, t5_llm):
    client = await start_app(aiohttp_client, t5_llm)
    for path in ("/tokenize", "/v1/chat/completions"):
        response = await client.post(path, json={"model": model_name(client), "messages": CHAT,
                                                 "chat_template": THINKING})
        answer = await response.json()
        assert response.status == 400 and answer["error"]["param"] == "chat_template"
        assert "--trust-request-chat-template" in answer["error"]["message"]


async def test_developer_role_is_a_system_turn(aiohttp_client, t5_llm):
    client = await start_app(aiohttp_client, t5_llm)
    developer = [{"role": "developer", "content": "Be brief."}, *CHAT]
    status, body = await _tokens(client, messages=developer)
    assert status == 200, body
    system = [{"role": "system", "content": "Be brief."}, *CHAT]
    assert body["tokens"] == (await _tokens(client, messages=system))[1]["tokens"]


def test_chat_template_flag_takes_a_file_or_a_template(tmp_path, capsys, tiny_llama_dir):
    path = tmp_path / "mine.jinja"
    path.write_text(THINKING)
    assert chat_template.template_argument(str(path)) == THINKING
    assert chat_template.template_argument(THINKING) == THINKING
    with pytest.raises(BadInput, match="no such file, and not a jinja2 template"):
        chat_template.template_argument(str(tmp_path / "missing.jinja"))
    # A template given inline that is longer than a file name (255 bytes), as launch lines
    # pass one: stat's ENAMETOOLONG was a traceback before the template was looked at.
    inline = "{# " + "a long comment " * 30 + "#}" + THINKING
    assert chat_template.template_argument(inline) == inline
    with pytest.raises(BadInput, match="no such file, and not a jinja2 template"):
        chat_template.template_argument("/tmp/" + "m" * 300 + ".jinja")
    with pytest.raises(BadInput, match=r"no tokenizer\.json"):
        Tokenizer(tiny_llama_dir, tokenizer_dir=str(tmp_path / ("t" * 300)))
    tok = Tokenizer(tiny_llama_dir)
    tok.use_chat_template(THINKING)
    assert tok.apply_chat_template(CHAT) == "<|user|>\nOnce upon<|end|>\n<|assistant|>\n"
    for bad in (str(tmp_path / "missing.jinja"), "{% for m in messages %}"):
        code = cli.main(["serve", "--model", str(tiny_llama_dir), "--chat-template", bad])
        assert code == 2
        assert capsys.readouterr().err.count("\n") == 1


def test_plan_takes_the_servers_chat_template_flags_as_no_ops(tiny_llama_dir, capsys):
    code = cli.main(["plan", "--model", str(tiny_llama_dir), "--device", "cpu",
                     "--chat-template", "x.jinja", "--trust-request-chat-template",
                     "--default-chat-template-kwargs", "{}"])
    assert code == 0, capsys.readouterr().err


@pytest.mark.parametrize("template, expected", [
    ("{% for m in messages %}{{ m['content'] }}{% endfor %}", "string"),
    ("{% for m in messages %}{% for p in m['content'] %}{{ p['text'] }}{% endfor %}"
     "{% endfor %}", "openai"),
    ("{% for m in messages %}{% for p in m.content %}{{ p.text }}{% endfor %}{% endfor %}",
     "openai"),
    # Llama 3.2 Vision's and Qwen2-VL's shape: a string, else its parts
    ("{% for m in messages %}{% if m['content'] is string %}{{ m['content'] }}{% else %}"
     "{% for c in m['content'] | selectattr('type', 'equalto', 'text') %}{{ c['text'] }}"
     "{% endfor %}{% endif %}{% endfor %}", "openai"),
    ("{% for m in messages %}{% for line in m['content'].split('\\n') %}{{ line }}"
     "{% endfor %}{% endfor %}", "string"),
    ("{% for m in messages %", "string"),  # not jinja2: compiled() refuses it
])
def test_the_content_format_auto_detects_is_vllms(template, expected):
    assert chat_template.content_format(template) == expected


def test_an_offline_callers_own_parts_reach_the_template_as_given():
    template = "{% for m in messages %}{{ m['content'] | length }}{% endfor %}"
    parts = [{"type": "image_url", "image_url": {"url": "x"}}, {"type": "text", "text": "a"}]
    assert chat_template.render(template, [{"role": "user", "content": parts}],
                                add_generation_prompt=False, tools=None, bos_token="",
                                eos_token="") == "2"
