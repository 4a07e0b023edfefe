"""What one request body may hold, and decoding its JSON within those limits.

``--max-body-bytes`` caps the bytes; these cap what parsing and validating them can
cost, so that no body stalls the event loop for long or ends in a 500. Every refusal
is a 400 whose message names the limit.
"""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np

from kvledger.engine.server.api_errors import bad_request

# json.loads recurses once per level of nesting (RecursionError near 1,000); real
# requests nest 4-5 levels.
MAX_JSON_DEPTH = 64
# Array elements plus object members in one body. json.loads holds the GIL throughout,
# so this bounds its time (tens of ms); a 128k-token prompt sent as token ids fits.
MAX_JSON_ITEMS = 150_000
MAX_MESSAGES = 2048
MAX_N = 128                           # OpenAI's limit on choices per request
MAX_LOGIT_BIAS_ENTRIES = 1024         # token ids in one request's logit_bias
MAX_CACHE_SALT_CHARS = 1024           # vLLM suggests 43 (256 random bits, base64)
MAX_ALLOWED_TOKEN_IDS = 1 << 18   # allowed_token_ids: a vocabulary's worth (Gemma 3: 262,144)
MAX_CLIENT_ID_CHARS = 256  # an X-Request-Id naming the answer (trace ids are 32-64)
# A client's id for its answer (X-Request-Id, request_id): visible ASCII, no space
CLIENT_ID_PATTERN = rf"^[!-~]{{1,{MAX_CLIENT_ID_CHARS}}}$"
MAX_STOP_STRINGS = 64                 # OpenAI allows 4
MAX_STOP_STRING_CHARS = 1024          # each
MAX_STOP_TOTAL_CHARS = 4096           # all of them together
MAX_STOP_TOKEN_IDS = 1024
MAX_INT = 2**63 - 1                   # every integer field is a signed 64-bit value

_OPENERS = (ord("["), ord("{"))
_CLOSERS = (ord("]"), ord("}"))
_STRUCTURAL = np.zeros(256, dtype=bool)
_STRUCTURAL[[*_OPENERS, *_CLOSERS, ord(",")]] = True
# JSON may escape half a surrogate pair (\ud800), which no UTF-8 text can hold: the
# tokenizer and every response would fail on it. Only an escape can produce one.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def decode_json(raw: bytes) -> Any:
    """The JSON value of a request body; a 400 ``invalid_json`` when it is not JSON,
    nests deeper than ``MAX_JSON_DEPTH`` or holds more than ``MAX_JSON_ITEMS`` items."""
    check_json_shape(raw)
    try:
        body = json.loads(raw)
    except RecursionError:  # unreachable after the depth check; never a 500 regardless
        raise _too_deep() from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise bad_request(f"invalid JSON body: {exc}", code="invalid_json") from None
    if _SURROGATE_ESCAPE.search(raw) and has_lone_surrogate(body):
        raise bad_request("invalid JSON body: a string holds an unpaired UTF-16 surrogate "
                          "escape (\\ud800-\\udfff)", code="invalid_json")
    return body


def check_json_shape(raw: bytes) -> None:
    """Refuse a body nesting too deep or holding too many items, before parsing it.

    A scan of the bytes outside strings, without recursion: vectorised with numpy, which
    releases the GIL, and skipped when the plain bracket and comma counts (strings
    included) are already within the limits, as for nearly every request.
    """
    opens = raw.count(b"[") + raw.count(b"{")
    if opens <= MAX_JSON_DEPTH and opens + raw.count(b",") <= MAX_JSON_ITEMS:
        return
    if b"\\" in raw:  # drop escaped backslashes, then escaped quotes: the rest delimit strings
        raw = raw.replace(b"\\\\", b"").replace(b'\\"', b"")
    data = np.frombuffer(raw, dtype=np.uint8)
    in_string = np.bitwise_xor.accumulate(data == ord('"'))
    marks = data[_STRUCTURAL[data] & ~in_string]
    step = np.isin(marks, _OPENERS).astype(np.int32) - np.isin(marks, _CLOSERS)
    depth = int(np.cumsum(step).max(initial=0))
    if depth > MAX_JSON_DEPTH:
        raise _too_deep()
    items = int(np.count_nonzero(marks == ord(","))) + int(np.count_nonzero(step == 1))
    if items > MAX_JSON_ITEMS:
        raise bad_request(f"invalid JSON body: more than {MAX_JSON_ITEMS} array elements and "
                          f"object members (the limit per request)", code="invalid_json")


def _too_deep():
    return bad_request(f"invalid JSON body: nested deeper than {MAX_JSON_DEPTH} levels "
                       f"(the limit per request)", code="invalid_json")


def few_messages(messages: Any) -> Any:
    """A chat's ``messages`` counted before any is validated (``MAX_MESSAGES``): the one
    rule of every endpoint that takes them (chat completions, ``/tokenize``)."""
    if isinstance(messages, list) and len(messages) > MAX_MESSAGES:
        raise ValueError(f"holds {len(messages)} messages; at most {MAX_MESSAGES} are "
                         f"allowed per request")
    return messages


def has_lone_surrogate(value: Any) -> bool:
    """Whether any string (key or value) inside ``value`` holds an unpaired surrogate.
    Iterative: a body may nest as deep as ``MAX_JSON_DEPTH`` allows, and the check must
    never be what fails on a deeper one."""
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return True
        elif isinstance(item, dict):
            pending.extend(item.keys())
            pending.extend(item.values())
        elif isinstance(item, list):
            pending.extend(item)
    return False


def shown(value: Any, limit: int = 40) -> str:
    """``repr(value)`` cut to ``limit`` characters, for error messages: a body may hold a
    400-digit number or a megabyte string, and the message should stay one short line."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_INT:
        return f"an integer of {len(str(abs(value)))} digits"
    text = repr(value[:limit + 1] if isinstance(value, str | list) else value)
    return text if len(text) <= limit else f"{text[:limit]}..."
