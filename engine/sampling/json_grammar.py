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
A request's own options (``JsonLayout``: vLLM's ``StructuredOutputsParams`` fields of those
names) win over the server's: its ``whitespace_pattern``, else its ``disable_any_whitespace``;
its ``disable_additional_properties`` closes objects whatever the backend. vLLM 0.32 takes
these fields and ignores them (its backends read only the server's config); a client that
sends them asks for that layout, so kvledger writes it.
"""

from __future__ import annotations

from dataclasses import dataclass
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


@dataclass(frozen=True)
class JsonLayout:
    """A request's own JSON options, over the server's ``--structured-outputs-config``."""

    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None  # a regex for the whitespace between tokens


def json_defaults(config: StructuredOutputsConfig,
                  layout: JsonLayout | None = None) -> dict[str, Any]:
    """llguidance's JSON options for ``config``'s backend and a request's ``layout``
    (empty: its defaults, vLLM's guidance backend's)."""
    if layout is not None and layout.whitespace_pattern is not None:
        return {"whitespace_pattern": layout.whitespace_pattern}
    if config.disable_any_whitespace or (layout is not None and layout.disable_any_whitespace):
        return {"whitespace_flexible": False}
    pattern = _WHITESPACE_PATTERNS.get(config.backend)
    return {} if pattern is None else {"whitespace_pattern": pattern}


def json_schema_source(schema: Any, config: StructuredOutputsConfig,
                       layout: JsonLayout | None = None) -> str:
    """The llguidance grammar of a JSON schema (a parsed object or boolean) under
    ``config`` and a request's ``layout``; ValueError from the library for a schema it
    refuses."""
    from llguidance import LLMatcher

    if config.closes_objects or (layout is not None and layout.disable_additional_properties):
        close_objects(schema)
    defaults = json_defaults(config, layout)
    return LLMatcher.grammar_from_json_schema(schema, defaults=defaults or None)


def laid_out_schema(schema: Any, config: StructuredOutputsConfig,
                    layout: JsonLayout | None = None) -> Any:
    """The schema itself with the options ``json_schema_source`` would pass folded into
    its ``x-guidance`` (its own keys win), for a grammar that embeds a schema (a
    structural tag's)."""
    if config.closes_objects or (layout is not None and layout.disable_additional_properties):
        close_objects(schema)
    defaults = json_defaults(config, layout)
    if not defaults or not isinstance(schema, dict):
        return schema
    own = schema.get("x-guidance")
    return {**schema, "x-guidance": {**defaults, **(own if isinstance(own, dict) else {})}}


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
