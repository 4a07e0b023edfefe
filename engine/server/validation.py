"""How a request body's fields are judged, before and after its model: the fields this
server knows but does not implement are refused by name (or dropped, when they change
nothing), and a failed validation becomes the 400 naming the first field at fault.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError
from pydantic.fields import FieldInfo

from kvledger.engine.server.api_errors import ApiError, bad_request
from kvledger.engine.server.limits import MAX_INT, MAX_N, shown

# Accepted and dropped: they change nothing this server returns (OpenAI's bookkeeping
# and routing hints). Each value is the type it must have.
IGNORED_FIELDS: dict[str, type | tuple[type, ...]] = {
    "metadata": dict, "store": bool, "service_tier": str, "parallel_tool_calls": bool,
    "prompt_cache_key": str, "safety_identifier": str, "modalities": list,
}
# Known fields this server does not implement: a 400 "not supported" unless the value
# is one of the neutral ones listed (which means "off").
UNSUPPORTED_FIELDS: dict[str, tuple[Any, ...]] = {
    "best_of": (None, 1), "suffix": (None, ""), "tools": (None, []),
    "tool_choice": (None, "none"), "functions": (None, []), "function_call": (None, "none"),
    "audio": (None,), "prediction": (None,),
    "web_search_options": (None,), "use_beam_search": (None, False),
    "length_penalty": (None, 1, 1.0), "truncate_prompt_tokens": (None,),
    "documents": (None, []),
    "prompt_logprobs": (None,), "guided_decoding_backend": (None,),
}
# vLLM's chat ``echo`` repeats the last message; not implemented (completions' is).
# Chat serves tools (``protocol``); completions refuse them.
CHAT_UNSUPPORTED_FIELDS = {**{k: v for k, v in UNSUPPORTED_FIELDS.items()
                              if k not in ("tools", "tool_choice")}, "echo": (None, False)}


class Strict(BaseModel):
    """Unknown fields refused, no coercion (``"10"`` is not 10), no NaN or infinity."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False,
                              hide_input_in_errors=True)


class Refusal(ValueError):
    """A 400 raised inside validation, with the field it names."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param = message, param


def known_fields(data: Any, unsupported: dict[str, tuple[Any, ...]],
                 declared: Mapping[str, FieldInfo] | None = None) -> Any:
    """A model's "before" validation: refuse the known-but-unsupported fields by name,
    drop the ignored ones the model does not ``declare`` (chat's ``parallel_tool_calls``),
    and read a ``null`` as unset where the field's default is not null (``"n": null`` is
    1, ``"stream": null`` false, as vLLM's ``X | None`` fields read; clients send unset
    fields as null)."""
    if not isinstance(data, dict):
        raise Refusal("the request body must be a JSON object")
    declared = declared or {}
    data = unset_nulls(data, declared)
    if not (unsupported.keys() & data.keys() or IGNORED_FIELDS.keys() & data.keys()):
        return data  # the common case: nothing to drop
    data = dict(data)
    for name in unsupported.keys() & data.keys():
        value = data.pop(name)
        if not any(value == v and type(value) is type(v) for v in unsupported[name]):
            raise Refusal(f"'{name}' is not supported by this server", name)
    for name in (IGNORED_FIELDS.keys() - declared.keys()) & data.keys():
        value = data.pop(name)
        if value is not None and not isinstance(value, IGNORED_FIELDS[name]):
            raise Refusal(f"'{name}' must be a {_type_name(IGNORED_FIELDS[name])}", name)
    return data


def unset_nulls(data: Any, declared: Mapping[str, FieldInfo]) -> Any:
    """``data`` without the ``null``s of fields whose default is not null: unset, they take
    it, as vLLM's ``X | None`` fields read a null."""
    if not isinstance(data, dict):
        return data  # the model says what it wanted
    nulls = [name for name, value in data.items() if value is None and name in declared
             and declared[name].get_default(call_default_factory=True) is not None]
    return {k: v for k, v in data.items() if k not in nulls} if nulls else data


def validate(model: type[BaseModel], body: Any) -> Any:
    """``model`` validated from ``body``, or the 400 naming the first field at fault."""
    try:
        return model.model_validate(body)
    except Refusal as exc:
        raise bad_request(exc.message, exc.param) from None
    except ValidationError as exc:
        raise _first_error(exc) from None


_TYPE_MESSAGES = {"int_type": "must be an integer", "float_type": "must be a number",
                  "bool_type": "must be true or false", "string_type": "must be a string",
                  "list_type": "must be a list", "dict_type": "must be a JSON object",
                  "model_type": "must be a JSON object", "finite_number": "must be finite"}


def refusal_within(exc: ValidationError, loc: tuple[int | str, ...]) -> Refusal:
    """The ``Refusal`` of a part of a body validated on its own (``loc``: where it sits in
    the body, ``("input", 3)``), naming the field as the whole body's validation would."""
    error = _first_error(exc, loc)
    return Refusal(error.message, error.param)


def _first_error(exc: ValidationError, within: tuple[int | str, ...] = ()) -> ApiError:
    error = exc.errors(include_url=False)[0]
    cause = (error.get("ctx") or {}).get("error")
    if isinstance(cause, Refusal):
        return bad_request(cause.message, cause.param)
    param = _param(within + tuple(error["loc"]))
    if not param:
        return bad_request("the request body must be a JSON object" if error["type"] ==
                           "model_type" else str(cause or error["msg"]))
    if error["type"] == "extra_forbidden":
        return bad_request(f"unknown field '{param}': this server does not implement it",
                           param)
    if error["type"] == "missing":
        return bad_request(f"missing required field '{param}'", param)
    if error["type"] in _TYPE_MESSAGES:
        return bad_request(f"'{param}' {_TYPE_MESSAGES[error['type']]}, got "
                           f"{shown(error['input'])}", param)
    message = str(cause) if isinstance(cause, ValueError) else error["msg"]
    return bad_request(f"'{param}': {message}", param)


def _param(loc: tuple[int | str, ...]) -> str:
    """``("messages", 0, "role")`` -> ``messages[0].role``; pydantic's union branch
    names (``str``, ``list[str]``) are dropped."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif "[" in part or part in ("str", "int", "float", "bool", "dict", "list"):
            continue
        else:
            out += f".{part}" if out else part
    return out


def _type_name(kind: type | tuple[type, ...]) -> str:
    return {dict: "JSON object", bool: "boolean", str: "string", list: "list"}.get(kind, "value")


def prompt_batch(prompt: Any, n: int) -> list[str | list[int]]:
    """A completions ``prompt`` as a batch: one prompt (a string or token ids) or a list of
    strings or of token-id lists, none empty, at most ``MAX_N`` choices with ``n`` each
    (ValueError, which pydantic reports for the field)."""
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt
                                   and all(_is_token_id(t) for t in prompt)):
        prompt = [prompt]  # one prompt
    if not isinstance(prompt, list) or not prompt \
            or not (all(isinstance(p, str) for p in prompt)
                    or all(isinstance(p, list) for p in prompt)):
        raise ValueError("must be a string, a list of token ids, a list of strings or a "
                         "list of token-id lists")
    for index, one in enumerate(prompt):
        where = "" if len(prompt) == 1 else f"prompt {index}: "
        if not one:
            raise ValueError(f"{where}must not be empty")
        if isinstance(one, list) and not all(_is_token_id(t) for t in one):
            raise ValueError(f"{where}token ids must be integers in [0, {MAX_INT}]")
    if len(prompt) * n > MAX_N:
        raise ValueError(f"{len(prompt)} prompts x n {n} = {len(prompt) * n} choices; at most "
                         f"{MAX_N} per request")
    return prompt


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_INT
