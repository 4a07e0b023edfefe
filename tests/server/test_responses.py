"""``POST /v1/responses`` on the tiny engine: served as the chat request it stands for, in
the Responses API's shapes, with the bodies the OpenAI SDK, the Agents SDK and LangChain
send (captured from openai 3.63, openai-agents 0.25, langchain-openai 1.8)."""

from __future__ import annotations

import json

import jsonschema
import pytest
from _server_helpers import fill_pool, make_llm, metric, model_name, start_app, wait_for_metric

from kvledger.engine.server.api_errors import ApiError
from kvledger.engine.server.responses_request import parse_responses
from kvledger.engine.server.state import STATE

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city"],
           "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]}}}
# The Agents SDK's function tool, as it sends it (flat, strict).
AGENTS_TOOL = {"name": "get_weather", "parameters": WEATHER, "strict": True, "type": "function",
               "description": "Weather for a city."}
CHAT_TOOL = {"type": "function", "function": {"name": "get_weather", "strict": True,
                                              "description": "Weather for a city.",
                                              "parameters": WEATHER}}
GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return make_llm(tiny_llama_dir, max_model_len=512, num_gpu_blocks_override=64)


def _events(raw: str) -> list[tuple[str, dict]]:
    """``(event, data)`` of each Server-Sent Event, checking the two name one type."""
    out = []
    for block in raw.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.split("\n"))
        data = json.loads(lines["data"])
        assert data["type"] == lines["event"]
        out.append((lines["event"], data))
    return out


async def _post(client, body: dict, status: int = 200) -> dict:
    response = await client.post("/v1/responses", json={"model": model_name(client), **body})
    assert response.status == status, await response.text()
    return await response.json()


async def _stream(client, body: dict) -> list[tuple[str, dict]]:
    response = await client.post("/v1/responses", json={
        "model": model_name(client), **body, "stream": True})
    assert response.status == 200 and response.headers["Content-Type"].startswith(
        "text/event-stream")
    return _events(await response.text())


async def test_text_whole_and_streamed_agree_and_the_cap_makes_it_incomplete(
        aiohttp_client, llm):
    client = await start_app(aiohttp_client, llm)
    body = {"input": "Once upon a time", "max_output_tokens": 9, **GREEDY}
    whole = await _post(client, body)
    assert whole["object"] == "response" and whole["id"].startswith("resp_")
    assert whole["status"] == "incomplete"
    assert whole["incomplete_details"] == {"reason": "max_output_tokens"}
    [message] = whole["output"]
    assert message["type"] == "message" and message["role"] == "assistant"
    assert message["id"].startswith("msg_") and message["status"] == "completed"
    [part] = message["content"]
    assert part["type"] == "output_text" and part["annotations"] == [] and part["text"]
    usage = whole["usage"]
    assert usage["output_tokens"] == 9
    assert usage["total_tokens"] == usage["input_tokens"] + 9
    assert usage["input_tokens_details"] == {"cached_tokens": 0}
    assert usage["output_tokens_details"] == {"reasoning_tokens": 0}
    # The request's parameters echoed, the sampling values in effect (vLLM's from_request)
    assert whole["max_output_tokens"] == 9 and whole["temperature"] == 0
    assert whole["tools"] == [] and whole["tool_choice"] == "none"
    assert whole["parallel_tool_calls"] is True and whole["truncation"] == "disabled"

    events = await _stream(client, body)
    kinds = [kind for kind, _ in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    assert events[0][1]["response"]["status"] == "in_progress"
    deltas = [data for kind, data in events if kind == "response.output_text.delta"]
    item_id = events[2][1]["item"]["id"]
    assert all(d["item_id"] == item_id and d["output_index"] == 0 and d["content_index"] == 0
               for d in deltas)
    assert "".join(d["delta"] for d in deltas) == part["text"]  # greedy: the same text
    assert events[-4][1]["text"] == part["text"]
    final = events[-1][1]["response"]
    assert final["status"] == "incomplete" and final["usage"]["output_tokens"] == 9
    assert final["output"][0]["id"] == item_id
    assert final["output"][0]["content"][0]["text"] == part["text"]


async def test_each_input_item_kind_is_the_chat_message_it_stands_for(aiohttp_client, llm):
    """Greedy, a conversation sent as Responses items answers as the same conversation
    sent to chat completions: the two render one prompt."""
    client = await start_app(aiohttp_client, llm)
    call = {"arguments": '{"city": "Paris"}', "call_id": "call_1", "name": "get_weather",
            "type": "function_call", "id": "fc_1", "status": "completed"}
    items = [
        {"role": "developer", "content": "Answer in French."},
        {"content": "hi", "role": "user", "type": "message"},  # LangChain's
        {"id": "msg_1", "type": "message", "role": "assistant", "status": "completed",
         "content": [{"annotations": [], "text": "Hello!", "type": "output_text",
                      "logprobs": []}]},  # an answer's item sent back whole
        {"role": "user", "content": [{"type": "input_text", "text": "Weather "},
                                     {"type": "input_text", "text": "in Paris?"}]},
        call, {"call_id": "call_1", "output": "sunny", "type": "function_call_output"},
    ]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "developer", "content": "Answer in French."},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [{"type": "text", "text": "Hello!"}]},
        {"role": "user", "content": [{"type": "text", "text": "Weather "},
                                     {"type": "text", "text": "in Paris?"}]},
        {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    answer = await _post(client, {"input": items, "instructions": "Be brief.",
                                  "tools": [AGENTS_TOOL], "tool_choice": "none",
                                  "max_output_tokens": 8, **GREEDY})
    chat = await (await client.post("/v1/chat/completions", json={
        "model": model_name(client), "messages": messages, "tools": [CHAT_TOOL],
        "tool_choice": "none", "max_tokens": 8, **GREEDY})).json()
    assert answer["output"][0]["content"][0]["text"] == chat["choices"][0]["message"]["content"]
    assert answer["usage"]["input_tokens"] == chat["usage"]["prompt_tokens"]
    assert answer["tools"] == [{"type": "function", "name": "get_weather",
                                "description": "Weather for a city.", "parameters": WEATHER,
                                "strict": True}]


async def test_a_function_call_round_trip_whole_and_streamed(aiohttp_client, llm):
    """A named function (its arguments constrained by the grammar) as a ``function_call``
    item, the same streamed; its output sent back, the model answers in text."""
    client = await start_app(aiohttp_client, llm)
    body = {"input": [{"content": "Weather in Paris?", "role": "user"}],
            "tools": [AGENTS_TOOL], "tool_choice": {"type": "function", "name": "get_weather"},
            "max_output_tokens": 60, **GREEDY}
    whole = await _post(client, body)
    assert whole["status"] == "completed"
    [call] = whole["output"]
    assert call["type"] == "function_call" and call["name"] == "get_weather"
    assert call["id"].startswith("fc_") and call["call_id"].startswith("call_")
    assert call["status"] == "completed"
    jsonschema.validate(json.loads(call["arguments"]), WEATHER)
    assert whole["tool_choice"] == {"type": "function", "name": "get_weather"}

    events = await _stream(client, body)
    kinds = [kind for kind, _ in events]
    assert kinds[:3] == ["response.created", "response.in_progress",
                         "response.output_item.added"]
    assert kinds[-3:] == ["response.function_call_arguments.done",
                          "response.output_item.done", "response.completed"]
    assert set(kinds[3:-3]) == {"response.function_call_arguments.delta"}
    added = events[2][1]["item"]
    assert added["type"] == "function_call" and added["status"] == "in_progress"
    arguments = "".join(d["delta"] for k, d in events if k.endswith("arguments.delta"))
    assert arguments == events[-3][1]["arguments"] == call["arguments"]
    assert events[-3][1]["name"] == "get_weather"
    streamed = events[-1][1]["response"]["output"]
    assert [i["type"] for i in streamed] == ["function_call"]
    assert streamed[0]["id"] == added["id"] and streamed[0]["arguments"] == arguments

    # The Agents SDK's next turn: the call sent back whole, then its output.
    body["input"] += [call, {"call_id": call["call_id"], "output": "sunny",
                             "type": "function_call_output"}]
    body.update(tool_choice="none", max_output_tokens=6)
    answer = await _post(client, body)
    assert [i["type"] for i in answer["output"]] == ["message"]
    assert answer["output"][0]["content"][0]["text"]


async def test_text_format_json_schema_output_validates(aiohttp_client, llm):
    client = await start_app(aiohttp_client, llm)
    schema = {"type": "object", "additionalProperties": False, "required": ["n"],
              "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}}
    text = {"format": {"type": "json_schema", "name": "digit", "schema": schema,
                       "strict": True}}
    answer = await _post(client, {"input": "A digit:", "text": text, "max_output_tokens": 40,
                                  "temperature": 0})
    assert answer["status"] == "completed"
    jsonschema.validate(json.loads(answer["output"][0]["content"][0]["text"]), schema)
    assert answer["text"] == text


async def test_logprobs_when_included(aiohttp_client, llm):
    client = await start_app(aiohttp_client, llm)
    body = {"input": "hi", "max_output_tokens": 4, "include": ["message.output_text.logprobs"],
            "top_logprobs": 2, **GREEDY}
    answer = await _post(client, body)
    logprobs = answer["output"][0]["content"][0]["logprobs"]
    assert len(logprobs) == 4 and all(len(e["top_logprobs"]) == 2 for e in logprobs)
    assert answer["top_logprobs"] == 2
    events = await _stream(client, body)
    streamed = [e for k, d in events if k == "response.output_text.delta" for e in d["logprobs"]]
    assert [e["token"] for e in streamed] == [e["token"] for e in logprobs]


@pytest.mark.parametrize("body, status, param, words", [
    ({"input": "hi", "tools": [{"type": "web_search"}]}, 400, "tools[0].type", "'web_search'"),
    ({"input": "hi", "tools": [{"type": "code_interpreter", "container": {"type": "auto"}}]},
     400, "tools[0].type", "'code_interpreter'"),
    ({"input": "hi", "background": True}, 400, "background", "keeps none"),
    ({"input": "hi", "previous_response_id": "resp_abc"}, 404, "previous_response_id",
     "resp_abc"),
    ({"input": "hi", "bogus": 1}, 400, "bogus", "unknown field"),
    ({"input": "hi", "prompt": {"id": "pmpt_1"}}, 400, "prompt", "prompt templates"),
    ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, 400, "input[0].type",
     "'web_search_call'"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     400, "input[0].content[0].type", "'input_image'"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, 400,
     "input[0].call_id", "missing"),
    ({"input": "hi", "max_output_tokens": 0}, 400, "max_output_tokens", ""),
    ({"input": "hi", "max_output_tokens": 600}, 400, "max_output_tokens",
     "lower max_output_tokens to at most"),  # the door's refusal, in this API's names
    ({"input": "hi", "temperature": "hot"}, 400, "temperature", "must be a number"),
    ({"input": "hi", "tool_choice": "required"}, 400, "tool_choice", "needs 'tools'"),
    ({"input": "hi", "reasoning": {"effort": "extreme"}}, 400, "reasoning.effort", ""),
    ({"input": []}, 400, "input", ""),
    ({"input": "hi", "tools": [AGENTS_TOOL]}, 400, "tool_choice", "--enable-auto-tool-choice"),
])
async def test_refusals_name_the_field(aiohttp_client, llm, body, status, param, words):
    client = await start_app(aiohttp_client, llm)
    error = (await _post(client, body, status))["error"]
    assert error["param"] == param and words in error["message"]


async def test_the_bodies_clients_send_by_default_are_taken(aiohttp_client, llm):
    client = await start_app(aiohttp_client, llm)
    for body in (
            {"input": "hi"},  # client.responses.create, litellm.responses
            {"include": [], "input": [{"content": "hi", "role": "user"}],  # Agents SDK
             "instructions": "Be brief."},
            {"stream": False, "input": [{"content": "hi", "role": "user", "type": "message"}],
             "reasoning": {"effort": "low"}},  # LangChain with a reasoning dict
            {"input": "hi", "store": True, "truncation": "disabled", "service_tier": "auto",
             "prompt_cache_key": "k", "safety_identifier": "u", "metadata": {"a": "b"},
             "include": ["reasoning.encrypted_content"], "text": {"verbosity": "low"},
             "parallel_tool_calls": None, "user": "me"}):
        answer = await _post(client, {**body, "max_output_tokens": 2, "ignore_eos": True})
        assert answer["status"] == "incomplete" and answer["usage"]["output_tokens"] == 2
        assert answer["output"][0]["content"][0]["text"]
    assert answer["metadata"] == {"a": "b"} and answer["user"] == "me"
    assert answer["service_tier"] == "auto" and answer["text"] == {"verbosity": "low"}


def test_reasoning_items_and_a_partial_answer_translate_as_vllm_reads_them():
    """A ``reasoning`` item joins the assistant message it precedes (``reasoning``); a last
    assistant message ``in_progress`` is continued, not answered (vLLM's partial answer)."""
    chat = parse_responses({"input": [
        {"role": "user", "content": "2+2?"},
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": "Add them."}]},
        {"type": "message", "role": "assistant", "status": "in_progress",
         "content": [{"type": "output_text", "text": "It is"}]}]})
    assert chat.template_messages[1] == {
        "role": "assistant", "content": [{"type": "text", "text": "It is"}],
        "reasoning": "Add them.", "reasoning_content": "Add them."}
    assert chat.continue_final_message and not chat.add_generation_prompt
    with pytest.raises(ApiError) as refused:
        parse_responses({"input": [{"type": "reasoning", "summary": [],
                                    "encrypted_content": "gAAA"}]})
    assert refused.value.param == "input[0].encrypted_content"


async def test_stored_responses_are_not_kept(aiohttp_client, llm):
    client = await start_app(aiohttp_client, llm)
    for response in (await client.get("/v1/responses/resp_abc"),
                     await client.post("/v1/responses/resp_abc/cancel")):
        assert response.status == 404
        error = (await response.json())["error"]
        assert "Response with id 'resp_abc' not found" in error["message"]
        assert error["param"] == "response_id"


async def test_a_full_pool_is_a_429_with_retry_after(aiohttp_client, tiny_llama_dir):
    client = await start_app(aiohttp_client, make_llm(tiny_llama_dir, admission="reserve"),
                             max_queue_len=0)
    ledger = client.app[STATE].door.engine.ledger
    held = fill_pool(ledger)
    try:
        for stream in (False, True):
            response = await client.post("/v1/responses", json={
                "model": model_name(client), "input": "hi", "stream": stream})
            assert response.status == 429
            assert int(response.headers["Retry-After"]) >= 1
            assert (await response.json())["error"]["code"] == "kv_cache_full"
    finally:
        ledger.release(held)


async def test_a_client_gone_mid_stream_releases_its_reservation(aiohttp_client, llm,
                                                                 monkeypatch):
    execute = llm.runner.execute

    def slow(batch):
        import time
        time.sleep(0.01)
        return execute(batch)

    monkeypatch.setattr(llm.runner, "execute", slow)
    client = await start_app(aiohttp_client, llm)
    aborted = await metric(client, "kvledger_requests_finished_total", 'finish_reason="abort"')
    response = await client.post("/v1/responses", json={
        "model": model_name(client), "input": "Tell me a long story", "stream": True,
        "ignore_eos": True})
    assert response.status == 200
    await response.content.readuntil(b"response.output_text.delta")  # it is writing
    assert await metric(client, "kvledger_kv_blocks_reserved") > 0
    response.connection.transport.abort()
    response.close()
    assert await wait_for_metric(client, "kvledger_kv_blocks_reserved", 0) == 0
    assert await metric(client, "kvledger_requests_finished_total",
                        'finish_reason="abort"') == aborted + 1


async def test_api_keys_guard_responses(aiohttp_client, llm):
    client = await start_app(aiohttp_client, llm, api_keys=("s3cret",))
    body = {"model": model_name(client), "input": "x", "max_output_tokens": 1}
    assert (await client.post("/v1/responses", json=body)).status == 401
    assert (await client.get("/v1/responses/resp_1")).status == 401
    response = await client.post("/v1/responses", json=body,
                                 headers={"Authorization": "Bearer s3cret"})
    assert response.status == 200
