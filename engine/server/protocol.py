"""Parse and validate OpenAI request bodies into one ``GenerationRequest``.

Only what kvledger implements is accepted: a field we would silently ignore in a way
that changes the answer (``n > 1``, ``logprobs``, penalties) is a 400, never a shrug.
Sizes are bounded by ``limits`` (messages, stop strings, 64-bit integers), each refusal
naming its limit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

from kvledger.engine.server.errors import bad_request
from kvledger.engine.server.limits import (
    MAX_INT,
    MAX_MESSAGES,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_STOP_TOTAL_CHARS,
    shown,
)

ROLES = ("system", "developer", "user", "assistant", "tool")
# Fields that change the output and that the engine does not implement: refuse unless
# they hold their neutral value.
_NEUTRAL = {"presence_penalty": 0, "frequency_penalty": 0, "logprobs": (None, False, 0),
            "top_logprobs": (None, 0), "echo": (None, False), "best_of": (None, 1),
            "logit_bias": (None, {}), "suffix": (None, ""), "tools": (None, []),
            "response_format": (None, {"type": "text"})}


@dataclass
class GenerationRequest:
    """One validated completion or chat request (n = 1)."""

    kind: Literal["completion", "chat"]
    model: str
    prompt: str | list[int] | None = None          # completions
    messages: list[dict[str, str]] | None = None   # chat: [{"role", "content"}]
    max_tokens: int | None = None                  # None: up to the context limit
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    stream: bool = False
    include_usage: bool = False
    user: str | None = None


def parse_completion(body: Any) -> GenerationRequest:
    obj = _object(body)
    req = GenerationRequest(kind="completion", model=_model(obj), prompt=_prompt(obj))
    _common(obj, req)
    req.max_tokens = _optional_positive_int(obj, "max_tokens")
    return req


def parse_chat(body: Any) -> GenerationRequest:
    obj = _object(body)
    req = GenerationRequest(kind="chat", model=_model(obj), messages=_messages(obj))
    _common(obj, req)
    # max_completion_tokens is the current name; max_tokens the deprecated one.
    newer = _optional_positive_int(obj, "max_completion_tokens")
    req.max_tokens = newer if newer is not None else _optional_positive_int(obj, "max_tokens")
    return req


def _object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    return body


def _model(obj: dict[str, Any]) -> str:
    if "model" not in obj:
        raise bad_request("missing required field 'model'", "model")
    if not isinstance(obj["model"], str):
        raise bad_request("'model' must be a string", "model")
    return obj["model"]


def _prompt(obj: dict[str, Any]) -> str | list[int]:
    if "prompt" not in obj:
        raise bad_request("missing required field 'prompt'", "prompt")
    prompt = obj["prompt"]
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise bad_request("'prompt' must not be empty", "prompt")
        return prompt
    if isinstance(prompt, list) and prompt and all(_is_token_id(t) for t in prompt):
        return list(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise bad_request("batched prompts are not supported: send one prompt per request",
                          "prompt")
    raise bad_request("'prompt' must be a non-empty string or a list of token ids", "prompt")


def _messages(obj: dict[str, Any]) -> list[dict[str, str]]:
    if "messages" not in obj:
        raise bad_request("missing required field 'messages'", "messages")
    messages = obj["messages"]
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list", "messages")
    if len(messages) > MAX_MESSAGES:
        raise bad_request(f"'messages' holds {len(messages)} messages; at most {MAX_MESSAGES} "
                          f"are allowed per request", "messages")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise bad_request(f"'{where}' must be an object", where)
        role = message.get("role")
        if role not in ROLES:
            raise bad_request(f"'{where}.role' must be one of {', '.join(ROLES)}", f"{where}.role")
        out.append({"role": role, "content": _content(message.get("content"), where)})
    return out


def _content(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if isinstance(content, list):
        texts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text"
                    and isinstance(part.get("text"), str)):
                raise bad_request(f"'{where}.content' parts must be {{\"type\": \"text\", "
                                  f"\"text\": ...}}; other modalities are not supported",
                                  f"{where}.content")
            texts.append(part["text"])
        return "".join(texts)
    raise bad_request(f"'{where}.content' must be a string or a list of text parts",
                      f"{where}.content")


def _common(obj: dict[str, Any], req: GenerationRequest) -> None:
    n = obj.get("n")
    if n is not None and (not _is_int(n) or n != 1):
        raise bad_request("only n=1 is supported", "n")
    for name, neutral in _NEUTRAL.items():
        value = obj.get(name)
        allowed = neutral if isinstance(neutral, tuple) else (None, neutral)
        if value not in allowed:
            raise bad_request(f"'{name}' is not supported by this server", name)
    req.temperature = _number(obj, "temperature", 1.0, low=0.0, high=2.0)
    req.top_p = _number(obj, "top_p", 1.0, low=0.0, high=1.0, low_open=True)
    top_k = obj.get("top_k")
    if top_k is not None:
        if not _is_int(top_k) or (top_k < 1 and top_k != -1) or top_k > MAX_INT:
            raise bad_request("'top_k' must be a positive integer or -1", "top_k")
        req.top_k = top_k
    seed = obj.get("seed")
    if seed is not None and not (_is_int(seed) and -(2**63) <= seed < 2**64):
        raise bad_request("'seed' must be a 64-bit integer", "seed")
    req.seed = seed
    req.stop = _stop(obj.get("stop"))
    ids = obj.get("stop_token_ids")
    if ids is not None:
        if not isinstance(ids, list) or not all(_is_token_id(t) for t in ids):
            raise bad_request("'stop_token_ids' must be a list of token ids", "stop_token_ids")
        if len(ids) > MAX_STOP_TOKEN_IDS:
            raise bad_request(f"'stop_token_ids' holds {len(ids)} ids; at most "
                              f"{MAX_STOP_TOKEN_IDS} are allowed", "stop_token_ids")
        req.stop_token_ids = list(ids)
    req.ignore_eos = _bool(obj, "ignore_eos", False)
    req.stream = _bool(obj, "stream", False)
    options = obj.get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            raise bad_request("'stream_options' must be an object", "stream_options")
        req.include_usage = _bool(options, "include_usage", False)
    user = obj.get("user")
    if user is not None and not isinstance(user, str):
        raise bad_request("'user' must be a string", "user")
    req.user = user


def _stop(stop: Any) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise bad_request("'stop' must be a non-empty string or a list of them", "stop")
    # Each stop string is matched against the text after every token: bound their work.
    if len(stop) > MAX_STOP_STRINGS:
        raise bad_request(f"'stop' holds {len(stop)} strings; at most {MAX_STOP_STRINGS} are "
                          f"allowed", "stop")
    longest = max(len(s) for s in stop)
    if longest > MAX_STOP_STRING_CHARS:
        raise bad_request(f"a 'stop' string is {longest} characters long; at most "
                          f"{MAX_STOP_STRING_CHARS} are allowed", "stop")
    total = sum(len(s) for s in stop)
    if total > MAX_STOP_TOTAL_CHARS:
        raise bad_request(f"the 'stop' strings hold {total} characters together; at most "
                          f"{MAX_STOP_TOTAL_CHARS} are allowed", "stop")
    return list(stop)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_token_id(value: Any) -> bool:
    return _is_int(value) and 0 <= value <= MAX_INT


def _optional_positive_int(obj: dict[str, Any], name: str) -> int | None:
    value = obj.get(name)
    if value is None:
        return None
    if not _is_int(value):
        raise bad_request(f"'{name}' must be an integer, got {shown(value)}", name)
    if not 1 <= value <= MAX_INT:
        raise bad_request(f"'{name}' must be in [1, {MAX_INT}], got {shown(value)}", name)
    return value


def _number(obj: dict[str, Any], name: str, default: float, *, low: float, high: float,
            low_open: bool = False) -> float:
    value = obj.get(name)
    if value is None:
        return default
    # An int is compared exactly (math.isfinite(10**400) would raise OverflowError).
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or (isinstance(value, float) and not math.isfinite(value)):
        raise bad_request(f"'{name}' must be a finite number", name)
    if value > high or value < low or (low_open and value == low):
        bracket = "(" if low_open else "["
        raise bad_request(f"'{name}' must be in {bracket}{low:g}, {high:g}], got {shown(value)}",
                          name)
    return float(value)


def _bool(obj: dict[str, Any], name: str, default: bool) -> bool:
    value = obj.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"'{name}' must be true or false", name)
    return value
