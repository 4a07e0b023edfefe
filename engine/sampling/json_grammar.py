"""A JSON constraint's llguidance grammar as ``--structured-outputs-config`` asks it
(``settings/structured_outputs_config.py``): the whitespace between tokens and which keys
an object may take, as vLLM 0.32's backend of that name writes JSON.

- Whitespace: llguidance's ``whitespace_flexible`` (any, the default; off with
  ``disable_any_whitespace``, as vLLM's guidance backend passes it: ``,`` and ``:`` with
  nothing around them), or a ``whitespace_pattern``: outlines' ``[ ]?`` (outlines_core's
  ``WHITESPACE``), lm-format-enforcer's at most 12 of space, tab, newline and return
  (``DEFAULT_MAX_CONSECUTIVE_WHITESPACES``).
- Keys: an object with ``properties`` (or ``patternProperties``) and no
  ``additionalProperties`` is closed, as vLLM's ``process_for_additional_properties``
  closes it for ``disable_additional_properties`` (the walk below is its), and as
  xgrammar's strict mode, outlines and lm-format-enforcer write objects.

These go in as llguidance's ``defaults``: a schema's own ``x-guidance`` wins, as with vLLM.
"""

from __future__ import annotations

from typing import Any

from kvledger.engine.settings.structured_outputs_config import StructuredOutputsConfig

# Keywords whose value maps names to subschemas, and keywords whose value is a subschema
# or a list of them (vLLM's _SCHEMA_MAP_KEYWORDS and _SUBSCHEMA_KEYWORDS).
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas",
                "dependencies")
_SUBSCHEMAS = ("additionalProperties", "unevaluatedProperties", "propertyNames", "contains",
               "additionalItems", "unevaluatedItems", "not", "if", "then", "else",
               "contentSchema", "items", "prefixItems", "allOf", "anyOf", "oneOf")
_WHITESPACE_PATTERNS = {"outlines": "[ ]?", "lm-format-enforcer": "[ \\t\\n\\r]{0,12}"}


def json_defaults(config: StructuredOutputsConfig) -> dict[str, Any]:
    """llguidance's JSON options for ``config``'s backend (empty: its defaults, vLLM's
    guidance backend's)."""
    if config.disable_any_whitespace:
        return {"whitespace_flexible": False}
    pattern = _WHITESPACE_PATTERNS.get(config.backend)
    return {} if pattern is None else {"whitespace_pattern": pattern}


def json_schema_source(schema: Any, config: StructuredOutputsConfig) -> str:
    """The llguidance grammar of a JSON schema (a parsed object or boolean) under
    ``config``; ValueError from the library for a schema it refuses."""
    from llguidance import LLMatcher

    if config.closes_objects:
        close_objects(schema)
    defaults = json_defaults(config)
    return LLMatcher.grammar_from_json_schema(schema, defaults=defaults or None)


def close_objects(schema: Any) -> None:
    """vLLM's walk (``_walk_json_for_additional_properties``), in place: every object
    schema with ``properties`` or ``patternProperties`` and no ``additionalProperties``
    gets ``additionalProperties: false``, nested ones too."""
    if isinstance(schema, list):
        for item in schema:
            if isinstance(item, dict):
                close_objects(item)
        return
    if not isinstance(schema, dict):
        return
    for key in _SCHEMA_MAPS:
        value = schema.get(key)
        if isinstance(value, dict):
            for subschema in value.values():
                if isinstance(subschema, dict):
                    close_objects(subschema)
    for key in _SUBSCHEMAS:
        value = schema.get(key)
        if isinstance(value, dict | list):
            close_objects(value)
    if "additionalProperties" not in schema and (
            isinstance(schema.get("properties"), dict)
            or isinstance(schema.get("patternProperties"), dict)):
        schema["additionalProperties"] = False
