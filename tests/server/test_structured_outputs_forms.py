"""vLLM 0.32's other ``structured_outputs`` forms on served requests: a context-free
``grammar`` (GBNF, as vLLM's docs write it, or Lark; ``guided_grammar`` too), a
``structural_tag`` (free text in which a trigger starts a tagged JSON value of its schema;
in ``structured_outputs`` and as ``response_format``), and the layout options a request
gives for itself (``disable_any_whitespace``, ``whitespace_pattern``,
``disable_additional_properties``). Tiny models with random weights, steered by a
``logit_bias``: whatever the weights favour, the answer keeps to the constraint."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from _server_helpers import make_llm, model_name, start_app, stop_app
from test_structured_outputs_config_http import SCHEMA, _whitespace_bias

SEEDS = range(4)
ASK = [{"role": "user", "content": "Write something."}]
# A GBNF grammar of the shape vLLM's structured outputs docs give (a tiny SQL).
SQL_GBNF = r'''
root ::= select_statement
select_statement ::= "SELECT " column " from " table " where " condition
column ::= "col_1 " | "col_2 "
table ::= "table_1 " | "table_2 "
condition ::= column "= " number
number ::= "1" | "2"
'''
SQL = re.compile(r"SELECT col_[12]  from table_[12]  where col_[12] = [12]")
TAG = {"triggers": ["<"], "structures": [
    {"begin": "<w>", "end": "</w>",
     "schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                "required": ["city"], "additionalProperties": False}}]}


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return make_llm(tiny_llama_dir, max_model_len=256)


async def _contents(client, llm, max_tokens: int = 60, bias: dict | None = None,
                    **extra) -> list[tuple[str, str]]:
    """Each seed's (content, finish_reason), sampled at temperature 1."""
    out = []
    for seed in SEEDS:
        body = {"model": model_name(client), "messages": ASK, "max_tokens": max_tokens,
                "seed": seed, "temperature": 1.0, **({"logit_bias": bias} if bias else {}),
                **extra}
        response = await client.post("/v1/chat/completions", json=body)
        assert response.status == 200, await response.text()
        choice = (await response.json())["choices"][0]
        out.append((choice["message"]["content"], choice["finish_reason"]))
    return out


@pytest.mark.parametrize("field", ["structured_outputs", "guided_grammar", "lark"])
async def test_a_grammar_is_kept_to(aiohttp_client, llm, field) -> None:
    client = await start_app(aiohttp_client, llm)
    extra = ({"guided_grammar": SQL_GBNF} if field == "guided_grammar" else
             {"structured_outputs": {"grammar": SQL_GBNF if field != "lark" else
                                     'start: "SELECT " ("a" | "b") " FROM t"'}})
    for content, finish in await _contents(client, llm, **extra):
        assert finish == "stop"
        assert (SQL.fullmatch(content) if field != "lark"
                else content in ("SELECT a FROM t", "SELECT b FROM t")), content
    await stop_app(client)


async def test_a_malformed_grammar_is_a_400(aiohttp_client, llm) -> None:
    client = await start_app(aiohttp_client, llm)
    body = {"model": model_name(client), "messages": ASK,
            "structured_outputs": {"grammar": "root ::= (\"a\""}}
    response = await client.post("/v1/chat/completions", json=body)
    assert response.status == 400
    assert "invalid grammar" in (await response.json())["error"]["message"]
    await stop_app(client)


@pytest.mark.parametrize("where", ["structured_outputs", "response_format"])
async def test_a_structural_tag_constrains_what_follows_its_trigger(aiohttp_client, llm,
                                                                  where) -> None:
    client = await start_app(aiohttp_client, llm)
    trigger = llm.tokenizer.encode("<", add_special_tokens=False)
    bias = {str(i): 4.0 for i in trigger}  # the weights steer into the trigger
    extra = ({"structured_outputs": {"structural_tag": json.dumps(TAG)}}
             if where == "structured_outputs" else
             {"response_format": {"type": "structural_tag", **TAG}})
    tagged = 0
    for content, _ in await _contents(client, llm, max_tokens=80, bias=bias, **extra):
        at = 0
        while (at := content.find("<", at)) >= 0:  # each trigger: <w>, a value, </w>
            if "<w>".startswith(content[at:]):  # cut off by max_tokens
                break
            assert content.startswith("<w>", at), content
            rest = content[at + len("<w>"):]
            try:
                value, end = json.JSONDecoder().raw_decode(rest)
            except ValueError:  # cut off by max_tokens: the last one only
                assert "</w>" not in rest, content
                break
            jsonschema.validate(value, TAG["structures"][0]["schema"])
            assert rest[end:end + len("</w>")] in ("</w>", "</w>"[:len(rest) - end]), content
            at += len("<w>") + end + len("</w>")
            tagged += 1
    assert tagged > 0  # the bias made the model write the trigger
    await stop_app(client)


async def test_a_requests_own_layout_options(aiohttp_client, llm) -> None:
    client = await start_app(aiohttp_client, llm)
    bias = _whitespace_bias(llm.tokenizer)
    flexible = await _contents(client, llm, bias=bias, structured_outputs={"json": SCHEMA})
    assert all(any(c.isspace() for c in content) for content, _ in flexible)
    compact = await _contents(client, llm, bias=bias, structured_outputs={
        "json": SCHEMA, "disable_any_whitespace": True})
    one_space = await _contents(client, llm, bias=bias, structured_outputs={
        "json": SCHEMA, "whitespace_pattern": "[ ]?"})
    for content, finish in compact + one_space:
        assert finish == "stop"
        jsonschema.validate(json.loads(content), SCHEMA)
    assert all(content == json.dumps(json.loads(content), separators=(",", ":"))
               for content, _ in compact)
    assert all("  " not in content and "\n" not in content for content, _ in one_space)
    await stop_app(client)


async def test_disable_additional_properties_closes_the_requests_objects(aiohttp_client,
                                                                          llm) -> None:
    open_schema = {"type": "object", "properties": {"a": {"type": "integer"}},
                   "required": ["a"]}
    client = await start_app(aiohttp_client, llm)
    # A choice of keys the weights favour: the closed object takes only "a".
    quote = llm.tokenizer.encode('","', add_special_tokens=False)
    for content, finish in await _contents(client, llm, bias={str(i): 4.0 for i in quote},
                                           structured_outputs={
                                               "json": open_schema,
                                               "disable_additional_properties": True}):
        if finish == "stop":
            assert list(json.loads(content)) == ["a"], content
    await stop_app(client)
