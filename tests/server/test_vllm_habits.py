"""What a client written against vLLM's server expects of the answers, over HTTP (a sweep
of vLLM 0.32's protocol and serving code found each of these different here): a
completion's default cap, ``echo`` alone, the stopping token out of the text, usage with
``stream_options``, streamed ``text_offset``, text parts and templates that read them.
After each, every reserved block is back."""

from __future__ import annotations

import dataclasses
import json

import pytest
from _server_helpers import make_llm, model_name, start_app

from kvledger.engine.server.state import STATE

# A template that loops over a message's content (as multimodal models' templates do):
# vLLM's "auto" hands it a list of parts.
PARTS_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n"
                  "{% if m['content'] is string %}{{ m['content'] }}{% else %}"
                  "{% for part in m['content'] %}[{{ part['text'] }}]{% endfor %}{% endif %}"
                  "<|end|>\n{% endfor %}<|assistant|>\n")


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return make_llm(tiny_llama_dir, max_num_seqs=8, num_gpu_blocks_override=64)


@pytest.fixture
async def client(aiohttp_client, llm):
    client = await start_app(aiohttp_client, llm, trust_request_chat_template=True)
    yield client
    ledger = llm.ledger
    assert ledger.reserved_blocks == 0 and ledger.used_blocks == 0


async def _post(client, path: str, body: dict) -> dict:
    response = await client.post(path, json={"model": model_name(client), **body})
    answer = await response.json()
    assert response.status == 200, answer
    return answer


async def _events(client, path: str, body: dict) -> list[dict]:
    response = await client.post(path, json={"model": model_name(client), "stream": True,
                                             **body})
    assert response.status == 200
    text = (await response.read()).decode()
    return [json.loads(line[6:]) for line in text.splitlines()
            if line.startswith("data: {")]


async def test_a_completion_without_max_tokens_stops_at_16_as_vllms(client):
    answer = await _post(client, "/v1/completions", {"prompt": "Once", "ignore_eos": True})
    assert answer["usage"]["completion_tokens"] == 16
    assert answer["choices"][0]["finish_reason"] == "length"
    # null asks for the rest of the context (256 - the prompt's tokens).
    whole = await _post(client, "/v1/completions", {"prompt": [5, 6], "ignore_eos": True,
                                                    "max_tokens": None})
    assert whole["usage"]["completion_tokens"] == 254
    # A prompt that leaves fewer than 16 tokens gets what is left, not a 400.
    short = await _post(client, "/v1/completions", {"prompt": [5] * 250, "ignore_eos": True})
    assert short["usage"]["completion_tokens"] == 6
    # A chat's unset cap is the rest of the context, as vLLM's.
    chat = await _post(client, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "ignore_eos": True})
    assert chat["usage"]["completion_tokens"] == 256 - chat["usage"]["prompt_tokens"]


@pytest.mark.parametrize("stream", [False, True])
async def test_echo_with_max_tokens_0_scores_the_prompt_alone(client, stream):
    body = {"prompt": "Once upon a time", "echo": True, "max_tokens": 0, "logprobs": 1}
    if stream:
        events = await _events(client, "/v1/completions",
                               {**body, "stream_options": {"include_usage": True}})
        text = "".join(e["choices"][0]["text"] for e in events if e["choices"])
        tokens = [t for e in events if e["choices"] and e["choices"][0]["logprobs"]
                  for t in e["choices"][0]["logprobs"]["tokens"]]
        usage = events[-1]["usage"]
    else:
        answer = await _post(client, "/v1/completions", body)
        text, usage = answer["choices"][0]["text"], answer["usage"]
        tokens = answer["choices"][0]["logprobs"]["tokens"]
    assert text == "Once upon a time"
    assert len(tokens) == usage["prompt_tokens"]  # the prompt's tokens, no generated one
    assert usage["completion_tokens"] == 0


async def test_the_token_that_stops_a_request_is_not_in_its_text(client, llm):
    tokenizer = llm.tokenizer
    eos = tokenizer.special_token_id("</s>")
    free = await _post(client, "/v1/completions", {"prompt": "Once", "max_tokens": 8,
                                                   "temperature": 0, "ignore_eos": True,
                                                   "logprobs": 0})
    ids = [int(t.split(":")[1]) for t in (await _post(client, "/v1/completions", {
        "prompt": "Once", "max_tokens": 8, "temperature": 0, "ignore_eos": True,
        "logprobs": 0, "return_tokens_as_token_ids": True}))["choices"][0]["logprobs"]["tokens"]]
    stop_at = ids[3]
    before = tokenizer.decode(ids[:ids.index(stop_at)])
    for stream in (False, True):
        body = {"prompt": "Once", "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                "stop_token_ids": [stop_at]}
        for keep in (False, True):
            asked = {**body, "include_stop_str_in_output": keep}
            if stream:
                text = "".join(e["choices"][0]["text"] for e in
                               await _events(client, "/v1/completions", asked) if e["choices"])
            else:
                text = (await _post(client, "/v1/completions", asked))["choices"][0]["text"]
            stopped = tokenizer.decode(ids[:ids.index(stop_at) + 1])
            assert text == (stopped if keep else before), (stream, keep)
    assert free["choices"][0]["text"].startswith(before)
    # EOS kept as text (skip_special_tokens false) is not in the text when it stops it.
    forced = await _post(client, "/v1/completions", {
        "prompt": "Once", "max_tokens": 4, "logit_bias": {str(eos): 100},
        "skip_special_tokens": False})
    assert forced["choices"][0]["finish_reason"] == "stop"
    assert "</s>" not in forced["choices"][0]["text"]


async def test_stream_options_as_vllm_reads_them(client):
    base = {"prompt": "Once", "max_tokens": 3, "ignore_eos": True}
    usage_events = [e for e in await _events(client, "/v1/completions",
                                             {**base, "stream_options": {}}) if "usage" in e]
    assert len(usage_events) == 1 and usage_events[0]["usage"]["completion_tokens"] == 3
    none = await _events(client, "/v1/completions", base)
    assert not any("usage" in e for e in none)
    off = await _events(client, "/v1/completions", {**base, "stream_options": {
        "include_usage": False, "continuous_usage_stats": True}})
    assert not any("usage" in e for e in off)
    every = await _events(client, "/v1/completions", {**base, "stream_options": {
        "continuous_usage_stats": True}})
    assert all("usage" in e for e in every)


async def test_streamed_text_offsets_are_the_whole_answers(client):
    body = {"prompt": "Once upon", "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "logprobs": 1, "echo": True}
    whole = (await _post(client, "/v1/completions", body))["choices"][0]["logprobs"]
    offsets = [o for e in await _events(client, "/v1/completions", body)
               if e["choices"] and e["choices"][0]["logprobs"]
               for o in e["choices"][0]["logprobs"]["text_offset"]]
    assert offsets == whole["text_offset"] and offsets == sorted(offsets) and offsets[-1] > 0


async def test_text_parts_join_by_newlines_or_reach_a_template_that_loops_over_them(
        client, llm):
    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}]
    messages = [{"role": "user", "content": parts}]
    tokenizer = llm.tokenizer

    async def prompt_ids(**extra) -> list[int]:
        response = await client.post("/tokenize", json={"model": model_name(client),
                                                        "messages": messages, **extra})
        assert response.status == 200
        return (await response.json())["tokens"]

    joined = tokenizer.decode(await prompt_ids(), skip_special_tokens=False)
    assert "Hello\nworld" in joined
    looped = tokenizer.decode(await prompt_ids(chat_template=PARTS_TEMPLATE),
                              skip_special_tokens=False)
    assert "[Hello][world]" in looped
    # A string's content reaches such a template as one part; "string" forces the join.
    state = client.app[STATE]
    options = state.options
    try:
        state.options = dataclasses.replace(options, chat_template_content_format="string")
        forced = tokenizer.decode(await prompt_ids(chat_template=PARTS_TEMPLATE),
                                  skip_special_tokens=False)
    finally:
        state.options = options
    assert "Hello\nworld" in forced and "[Hello]" not in forced


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_stop_reason_names_the_stop_string_or_token_as_vllms(client, path):
    """vLLM's ``stop_reason``: the stop string or stop token id that ended a choice; null
    for EOS, the cap and the rest; on the streamed choices too."""
    ask = ({"prompt": "Once"} if path == "/v1/completions" else
           {"messages": [{"role": "user", "content": "Once"}]})
    base = {**ask, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "return_tokens_as_token_ids": True}
    free = await _post(client, path, {**base, "logprobs": 0} if "prompt" in ask else
                       {**base, "logprobs": True})
    choice = free["choices"][0]
    assert choice["finish_reason"] == "length" and choice["stop_reason"] is None
    if "prompt" in ask:
        ids = [int(t.split(":")[1]) for t in choice["logprobs"]["tokens"]]
        text = choice["text"]
    else:
        ids = [int(e["token"].split(":")[1]) for e in choice["logprobs"]["content"]]
        text = choice["message"]["content"]
    word = text[2:4]
    cases = [({"stop_token_ids": [ids[5]]}, ids[5]), ({"stop": [word]}, word)]
    for extra, reason in cases:
        answer = (await _post(client, path, {**base, **extra}))["choices"][0]
        assert (answer["finish_reason"], answer["stop_reason"]) == ("stop", reason)
        events = await _events(client, path, {**base, **extra})
        last = [e["choices"][0] for e in events if e["choices"]][-1]
        assert (last["finish_reason"], last["stop_reason"]) == ("stop", reason)


async def test_x_request_id_names_the_answer_and_two_clients_never_meet(client):
    """vLLM's: the answer's id is ``cmpl-`` + the client's X-Request-Id. The engine keys
    requests by its own ids: two requests sent at once under one id both run whole."""
    import asyncio

    body = {"model": model_name(client), "prompt": "Once", "max_tokens": 24,
            "ignore_eos": True}
    headers = {"X-Request-Id": "trace-0af7651916cd43dd"}

    async def ask(stream: bool) -> tuple[str, int]:
        response = await client.post("/v1/completions", json={**body, "stream": stream},
                                     headers=headers)
        assert response.status == 200
        if not stream:
            answer = await response.json()
            return answer["id"], answer["usage"]["completion_tokens"]
        events = [json.loads(line[6:]) for line in (await response.read()).decode().splitlines()
                  if line.startswith("data: {")]
        return events[0]["id"], sum(1 for e in events if e["choices"] and e["choices"][0]["text"])

    answers = await asyncio.gather(ask(False), ask(False), ask(True))
    assert {answer_id for answer_id, _ in answers} == {"cmpl-trace-0af7651916cd43dd"}
    assert [n for _, n in answers[:2]] == [24, 24] and answers[2][1] > 0
    for bad in ("a b", "x" * 257, "é"):
        response = await client.post("/v1/completions", json=body,
                                     headers={"X-Request-Id": bad})
        assert response.status == 400
        assert "X-Request-Id" in (await response.json())["error"]["message"]


async def test_add_special_tokens_as_vllm_reads_it(client, llm):
    """vLLM's field: a completion's prompt gets the tokenizer's BOS unless it is false; a
    chat's rendered template gets none unless it is true."""
    bos = llm.tokenizer.bos_token

    async def prompt_tokens(path: str, body: dict) -> int:
        return (await _post(client, path, {**body, "max_tokens": 1}))["usage"]["prompt_tokens"]

    plain = await prompt_tokens("/v1/completions", {"prompt": "Once"})
    bare = await prompt_tokens("/v1/completions", {"prompt": "Once", "add_special_tokens": False})
    assert bos and plain == bare + 1
    ask = {"messages": [{"role": "user", "content": "hi"}]}
    chat = await prompt_tokens("/v1/chat/completions", ask)
    doubled = await prompt_tokens("/v1/chat/completions", {**ask, "add_special_tokens": True})
    assert doubled == chat + 1  # the template's BOS, then the tokenizer's


async def test_the_bodys_request_id_names_the_answer_unless_the_header_does(client):
    body = {"prompt": "Once", "max_tokens": 1, "request_id": "job-7"}
    assert (await _post(client, "/v1/completions", body))["id"] == "cmpl-job-7"
    response = await client.post("/v1/completions", json={"model": model_name(client), **body},
                                 headers={"X-Request-Id": "trace-1"})
    assert (await response.json())["id"] == "cmpl-trace-1"
    response = await client.post("/v1/completions", json={
        "model": model_name(client), **body, "request_id": "has space"})
    assert response.status == 400 and (await response.json())["error"]["param"] == "request_id"


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_return_token_ids_gives_the_ids_whole_and_streamed(client, path):
    """vLLM's ``return_token_ids`` (RL frameworks read rollouts' ids, not the text back):
    the prompt's ids (a chat's on the answer, a completion's on each choice) and each
    choice's output ids; streamed, each chunk the ids its text came from, the prompt's with
    the first chunk."""
    chat = path.endswith("chat/completions")
    ask = ({"messages": [{"role": "user", "content": "Once"}]} if chat else {"prompt": "Once"})
    body = {**ask, "max_tokens": 9, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "n": 2}
    whole = await _post(client, path, body)
    tokenized = await _post(client, "/tokenize", ask)
    prompt_ids = whole["prompt_token_ids"] if chat else whole["choices"][0]["prompt_token_ids"]
    assert prompt_ids == tokenized["tokens"]
    assert [len(c["token_ids"]) for c in whole["choices"]] == [9, 9]
    events = await _events(client, path, body)
    streamed = {0: [], 1: []}
    for event in events:
        for choice in event["choices"]:
            streamed[choice["index"]] += choice["token_ids"]
    assert [streamed[0], streamed[1]] == [c["token_ids"] for c in whole["choices"]]
    firsts = [e for e in events if "prompt_token_ids" in (e if chat else e["choices"][0])]
    assert len(firsts) == 2  # once per choice
    plain = await _post(client, path, {**ask, "max_tokens": 2})
    assert "prompt_token_ids" not in plain and "token_ids" not in plain["choices"][0]


async def test_allowed_token_ids_bound_one_request_alone(client):
    """vLLM's ``allowed_token_ids``: the request samples among those ids only (its own
    logits row selected), greedy and seeded alike; a request beside it in the same steps
    draws exactly what it draws alone."""
    import asyncio

    plain = {"prompt": "Once", "max_tokens": 12, "temperature": 0, "ignore_eos": True,
             "logprobs": 0, "return_tokens_as_token_ids": True}

    def ids(answer: dict) -> list[int]:
        return [int(t.split(":")[1]) for t in answer["choices"][0]["logprobs"]["tokens"]]

    alone = ids(await _post(client, "/v1/completions", plain))
    allowed = [alone[1], alone[4], 17]
    bounded, beside = await asyncio.gather(
        _post(client, "/v1/completions", {**plain, "allowed_token_ids": allowed,
                                           "temperature": 1.0, "seed": 3}),
        _post(client, "/v1/completions", plain))
    assert set(ids(bounded)) <= set(allowed) and ids(beside) == alone
    greedy = ids(await _post(client, "/v1/completions", {**plain, "allowed_token_ids": allowed}))
    assert set(greedy) <= set(allowed)
    for bad in ([], [10**6]):
        response = await client.post("/v1/completions", json={
            "model": model_name(client), **plain, "allowed_token_ids": bad})
        assert response.status == 400
        assert (await response.json())["error"]["param"] == "allowed_token_ids"


async def test_allowed_token_ids_beside_an_output_constraint_is_refused(client):
    for extra in ({"response_format": {"type": "json_object"}},
                  {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
                   "tool_choice": "required"}):
        response = await client.post("/v1/chat/completions", json={
            "model": model_name(client), "messages": [{"role": "user", "content": "x"}],
            "allowed_token_ids": [5, 6], **extra})
        assert response.status == 400
        assert (await response.json())["error"]["param"] == "allowed_token_ids"


async def test_bad_words_are_never_written_as_vllm_reads_them(client, llm):
    """vLLM's ``bad_words``: each word's token sequences, alone and after a space; a
    sequence's last token is out of the request's row once the rest ends the output."""
    from kvledger.engine.sampling.bad_words import BadWordSequences, BadWordsMatcher, word_sequences

    plain = {"prompt": "Once upon a time", "max_tokens": 24, "temperature": 0,
             "ignore_eos": True, "logprobs": 0, "return_tokens_as_token_ids": True}

    def ids(answer: dict) -> list[int]:
        return [int(t.split(":")[1]) for t in answer["choices"][0]["logprobs"]["tokens"]]

    def written(seq, output) -> bool:
        return any(tuple(output[i:i + len(seq)]) == tuple(seq)
                   for i in range(len(output) - len(seq) + 1))

    free = ids(await _post(client, "/v1/completions", plain))
    tokenizer = llm.tokenizer

    def sequences_of(word: str):
        return word_sequences(lambda text: tokenizer.encode(text, add_special_tokens=False),
                              [word])

    # A word the free answer writes as one of its sequences (a whole token, say " the").
    word = next(w for t in free if (w := tokenizer.decode([t]).strip()).isalpha()
                and any(written(s, free) for s in sequences_of(w)))
    import asyncio

    answer, beside = await asyncio.gather(  # a request beside it draws what it draws alone
        _post(client, "/v1/completions", {**plain, "bad_words": [word]}),
        _post(client, "/v1/completions", plain))
    bounded = ids(answer)
    assert ids(beside) == free
    for seq in sequences_of(word):
        assert not written(seq, bounded), (word, seq, bounded)
    assert bounded != free
    # The rule itself: a sequence's last token goes once the rest ends the output.
    assert BadWordsMatcher(BadWordSequences([(3, 4), (7,)])).banned([1, 3]) == [4, 7]
    assert BadWordsMatcher(BadWordSequences([(3, 4)])).banned([3, 1]) == []
    response = await client.post("/v1/completions", json={
        "model": model_name(client), **plain, "bad_words": [""]})
    assert response.status == 400


async def test_bad_words_never_let_a_token_outside_allowed_token_ids(client, llm):
    """Bad words beside ``allowed_token_ids``: one-token words that are every allowed id
    are refused (400, naming ``bad_words``); words the output begins that ban every
    allowed id end it there with ``"grammar"``, never a token from outside them; a request
    beside it draws what it draws alone."""
    import asyncio

    def encode(text: str) -> list[int]:
        return llm.tokenizer.encode(text, add_special_tokens=False)

    one, spaced = encode("the"), encode(" the")  # one token each
    assert len(one) == len(spaced) == 1
    response = await client.post("/v1/completions", json={
        "model": model_name(client), "prompt": "Once", "allowed_token_ids": one + spaced,
        "bad_words": ["the"]})
    assert response.status == 400
    assert (await response.json())["error"]["param"] == "bad_words"
    doubled = encode("aa")  # a twice: the first is allowed, then nothing is
    assert len(doubled) == 2 and doubled[0] == doubled[1]
    plain = {"prompt": "Once", "max_tokens": 8, "ignore_eos": True, "temperature": 0,
             "return_token_ids": True}
    alone = await _post(client, "/v1/completions", plain)
    for extra in ({"temperature": 0}, {"temperature": 1.0, "seed": 5}):
        ended, beside = await asyncio.gather(
            _post(client, "/v1/completions", {**plain, **extra, "bad_words": ["aa"],
                                               "allowed_token_ids": doubled[:1]}),
            _post(client, "/v1/completions", plain))
        choice = ended["choices"][0]
        assert choice["finish_reason"] == "grammar" and choice["token_ids"] == doubled[:1]
        assert beside["choices"][0]["token_ids"] == alone["choices"][0]["token_ids"]


async def test_the_answers_role_is_vllms(client):
    """vLLM's ``get_chat_request_role``: ``--response-role`` (assistant) with a generation
    prompt, else the last message's role (a continued message's)."""
    base = {"max_tokens": 2, "ignore_eos": True}
    ask = [{"role": "user", "content": "hi"}]
    answer = await _post(client, "/v1/chat/completions", {**base, "messages": ask})
    assert answer["choices"][0]["message"]["role"] == "assistant"
    continued = [*ask, {"role": "assistant", "content": "Once"}]
    for body in ({"messages": continued, "continue_final_message": True},
                 {"messages": ask, "add_generation_prompt": False}):
        answer = await _post(client, "/v1/chat/completions", {**base, **body})
        assert answer["choices"][0]["message"]["role"] == body["messages"][-1]["role"]
        events = await _events(client, "/v1/chat/completions", {**base, **body})
        assert events[0]["choices"][0]["delta"]["role"] == body["messages"][-1]["role"]
    state = client.app[STATE]
    options = state.options
    try:
        state.options = dataclasses.replace(options, response_role="model")
        answer = await _post(client, "/v1/chat/completions", {**base, "messages": ask})
    finally:
        state.options = options
    assert answer["choices"][0]["message"]["role"] == "model"
