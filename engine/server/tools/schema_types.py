"""A parameter's text turned into the JSON type its schema declares, as vLLM 0.32 turns
it (``vllm/tool_parsers/utils.py``: ``extract_types_from_schema``,
``coerce_to_schema_type``; ``ParserEngine._coerce_value``): formats that write values as
bare text (qwen3_coder's ``<parameter=days>\\n3\\n</parameter>``) leave their type to the
declared schema. Written to give the same values for the same text, down to the
priority of the types tried and the strings kept where no type fits.
"""

from __future__ import annotations

import json
import math
from typing import Any

# vLLM's spellings of the JSON types (as some tool schemas write them).
_TYPE_ALIASES = {
    "str": "string", "text": "string", "varchar": "string", "char": "string",
    "enum": "string", "int": "integer", "int32": "integer", "int64": "integer",
    "uint": "integer", "uint32": "integer", "uint64": "integer", "long": "integer",
    "short": "integer", "unsigned": "integer", "float": "number", "float32": "number",
    "float64": "number", "double": "number", "bool": "boolean", "dict": "object",
    "arr": "array", "list": "array", "sequence": "array",
}
_PRIORITY = ("null", "integer", "number", "boolean", "object", "array", "string")


def schema_types(schema: Any) -> set[str]:
    """The JSON types a schema allows: its ``type``, its ``enum`` values' types, those of
    its ``anyOf``/``oneOf``/``allOf`` branches; ``{"string"}`` when it says none."""
    if not isinstance(schema, dict):
        return {"string"}
    types: set[str] = set()
    declared = schema.get("type")
    if isinstance(declared, str):
        types.add(declared)
    elif isinstance(declared, list):
        types.update(t for t in declared if isinstance(t, str))
    enum = schema.get("enum")
    if isinstance(enum, list):
        types.update(_value_type(v) for v in enum)
        types.discard("")
    for key in ("anyOf", "oneOf", "allOf"):
        if isinstance(schema.get(key), list):
            for branch in schema[key]:
                types |= schema_types(branch)
    return types or {"string"}


def _value_type(value: Any) -> str:
    if value is None:
        return "null"
    for kind, name in ((bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"),
                       (list, "array"), (dict, "object")):
        if isinstance(value, kind):
            return name
    return ""


def coerce(value: str, types: set[str]) -> Any:
    """``value`` as the first of ``types`` (null, integer, number, boolean, object, array,
    string) it reads as; else JSON if it is some, else the string itself."""
    normalized = {_TYPE_ALIASES.get(t.strip().lower(), t.strip().lower()) for t in types}
    for kind in _PRIORITY:
        if kind not in normalized:
            continue
        if kind == "string":
            return value
        read = _READERS[kind](value)
        if read is not _NO:
            return read
    try:
        parsed = json.loads(value)
    except (ValueError, RecursionError):  # (vLLM's would fail the request on the second)
        return value
    return parsed if _finite(parsed) else value


_NO = object()


def _null(value: str) -> Any:
    return None if value.lower() == "null" else _NO


def _integer(value: str) -> Any:
    try:
        return int(value)
    except ValueError:
        return _NO


def _number(value: str) -> Any:
    try:
        number = float(value)
    except ValueError:
        return _NO
    if not math.isfinite(number):
        return _NO
    return number if number != int(number) else int(number)


def _boolean(value: str) -> Any:
    lowered = value.lower().strip()
    return True if lowered in ("true", "1") else False if lowered in ("false", "0") else _NO


def _json(value: str) -> Any:
    try:
        parsed = json.loads(value)
    except (ValueError, RecursionError):
        return _NO
    return parsed if _finite(parsed) else _NO


_READERS = {"null": _null, "integer": _integer, "number": _number, "boolean": _boolean,
            "object": _json, "array": _json}


def _finite(value: Any) -> bool:
    """Whether ``value`` can be written as JSON (no inf or nan anywhere in it)."""
    try:
        json.dumps(value, allow_nan=False)
    except (ValueError, TypeError, RecursionError):
        return False
    return True


def coerced(value: str, schema: Any) -> Any:
    """A string parameter as its property's schema types it (``value`` itself when the
    property has no schema)."""
    return coerce(value, schema_types(schema)) if isinstance(schema, dict) else value


def string_only(schema: Any) -> bool:
    """Whether a property's value stays the string written, whatever it holds (so its
    text can be streamed before it is closed)."""
    return not isinstance(schema, dict) or schema_types(schema) == {"string"}


def retyped(arguments: str, properties: dict[str, Any]) -> str:
    """A call's JSON arguments with each value retyped by its declared property's schema,
    as vLLM's parser engine retypes them (``ParserEngine._fix_arg_types``): a string as
    ``coerced``; another scalar written as JSON, then so (``3`` a ``"3"`` for a string
    property); objects and arrays value by value through their ``properties`` and
    ``items``. The text unchanged when nothing is retyped or it is no JSON object."""
    try:
        values = json.loads(arguments)
    except ValueError:
        return arguments
    if not isinstance(values, dict) or not properties:
        return arguments
    return json.dumps(values, ensure_ascii=False) if _retype_all(values, properties) \
        else arguments


def _retype_all(values: dict[str, Any], properties: dict[str, Any]) -> bool:
    changed = False
    for key, value in values.items():
        schema = properties.get(key)
        if isinstance(schema, dict):
            new, value_changed = _retype(value, schema)
            if value_changed:
                values[key], changed = new, True
    return changed


def _retype(value: Any, schema: dict[str, Any]) -> tuple[Any, bool]:
    if isinstance(value, str):
        new = coerce(value, schema_types(schema))
        return new, new is not value
    if isinstance(value, dict):
        nested = schema.get("properties")
        return value, isinstance(nested, dict) and _retype_all(value, nested)
    if isinstance(value, list):
        items, changed = schema.get("items"), False
        if isinstance(items, dict):
            for i, item in enumerate(value):
                new, item_changed = _retype(item, items)
                if item_changed:
                    value[i], changed = new, True
        return value, changed
    new = coerce(json.dumps(value, ensure_ascii=False), schema_types(schema))
    return new, type(new) is not type(value) or new != value
