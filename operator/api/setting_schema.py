"""What a declared setting is in the InferenceService's schema (OpenAPI v3): each kind of
setting's schema, a setting's property (description, default, its own keys) and a
section's properties from a config's declarations (``engine/settings/declare.py``); and the
grammars the schema shares with the engine, derived from the engine's own regexes, never
written a second time: a SIZE (``kvledger.engine.settings.kinds``) and a hub uri
(``kvledger.engine.checkpoint.hub.uri``). ``crd_schema.py`` builds the spec from these."""

from __future__ import annotations

import json
import re
from dataclasses import MISSING
from typing import Any

from kvledger.engine.checkpoint.hub.uri import HUB_URI_RE
from kvledger.engine.settings.config import EngineConfig
from kvledger.engine.settings.declare import Setting, default_of, settings_of
from kvledger.engine.settings.kinds import SIZE_RE
from kvledger.engine.settings.structured_outputs_config import BACKENDS, SPEC_KEYS


def crd_pattern(owner: re.Pattern[str]) -> str:
    """An owner's regex as a schema ``pattern``: anchored, its named groups plain (the API
    server reads patterns with Go's RE2, ``kvledger run`` with Python's ``re``; both take
    this), and without the whitespace a command line tolerates around a value."""
    body = re.sub(r"\(\?P<\w+>", "(", owner.pattern).replace(r"\s*", "")
    return f"^{body.removeprefix('^').removesuffix('$')}$"


# A SIZE, as engine.setting_kinds.parse_size reads it (40Gi, 40GiB, 40G, 512MiB, plain bytes).
SIZE_PATTERN = crd_pattern(SIZE_RE)
# hf://ORG/NAME[@REVISION], as the engine's parse_uri matches it before its own checks
# (no leading or trailing '.' or '-' in a name, a revision's characters), which the
# operator and `kvledger run` apply with the engine's message.
HUB_URI_PATTERN = crd_pattern(HUB_URI_RE)


_SIZE = {"type": "string", "pattern": SIZE_PATTERN}
# Structural int-or-string: the anyOf must be exactly these two bare types; value checks
# sit beside it (minimum applies to the integer, pattern to the string), as for Quantity.
INT_OR_STRING = [{"type": "integer"}, {"type": "string"}]


def integer(minimum: int, description: str, **extra: Any) -> dict[str, Any]:
    """An integer field of the CRD, at least ``minimum``."""
    return {"type": "integer", "minimum": minimum, "description": description, **extra}
_SIZE_OR_BYTES = {"x-kubernetes-int-or-string": True, "anyOf": INT_OR_STRING, "minimum": 1,
                  "pattern": SIZE_PATTERN}
_SO_HELP = {
    "backend": "auto or guidance is llguidance, kvledger's engine; xgrammar, outlines or "
               "lm-format-enforcer the same engine writing JSON as theirs (objects take only "
               "their listed keys; their whitespace)",
    "disableAnyWhitespace": "JSON without whitespace (backend xgrammar or guidance)",
    "disableAdditionalProperties": "objects take only their listed keys (backend guidance)",
    "enableInReasoning": "with reasoningParser, the output constraint applies from the first "
                         "token, reasoning included (else once the reasoning ends)"}
# What each kind of setting (engine/settings/kinds.py, serve_values.py) is in OpenAPI;
# "choice" is an enum.
KIND_SCHEMAS: dict[str, dict[str, Any]] = {
    "integer": {"type": "integer"},
    "positive": {"type": "integer", "minimum": 1},
    "count": {"type": "integer", "minimum": 0},
    "port": {"type": "integer", "minimum": 1},  # serve's 0 (any free port) is no Service's
    "boolean": {"type": "boolean"},
    "fraction": {"type": "number", "minimum": 0, "exclusiveMinimum": True, "maximum": 1},
    "share": {"type": "number", "minimum": 0, "maximum": 1, "exclusiveMaximum": True},
    "seconds": {"type": "number", "minimum": 0, "exclusiveMinimum": True},
    "seconds_or_zero": {"type": "number", "minimum": 0},
    "size": _SIZE,
    "bytes": _SIZE_OR_BYTES,
    "text": {"type": "string", "minLength": 1},
    "object": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
    # vLLM's structured outputs config, its keys camelCased (SPEC_KEYS: the engine's)
    "structured_outputs": {"type": "object", "properties": {
        name: ({"type": "string", "enum": list(BACKENDS)} if key == "backend"
               else {"type": "boolean"}) | {"description": f"vLLM's {key}: {_SO_HELP[name]}"}
        for name, key in SPEC_KEYS.items()}},
}


def setting_schema(declared: Setting, default: Any = MISSING) -> dict[str, Any]:
    """A setting's CRD property: its kind's schema, its description (where it writes
    ``%(default)s``, the field's ``default`` as the resource writes it, JSON), its own keys,
    and the default when the CRD declares it (``Crd.defaulted``)."""
    kind, crd = declared.kind, declared.crd
    if kind.domain == "choice":
        typed = "integer" if all(isinstance(v, int) for v in kind.values) else "string"
        schema = {"type": typed, "enum": list(kind.values)}
    else:
        schema = dict(KIND_SCHEMAS[kind.domain])
    if crd is not None and crd.description:
        schema["description"] = (crd.description % {"default": json.dumps(default, default=str)}
                                 if default is not MISSING else crd.description)
    schema = {**schema, **(crd.schema if crd is not None else {})}
    if crd is not None and crd.defaulted:
        schema["default"] = default
    return schema


def setting_properties(section: str, config_type: type = EngineConfig) -> dict:
    """``spec.<section>``'s properties (``""``: ``spec``'s own): one per setting of
    ``config_type`` declared there, in the order of its fields."""
    return {declared.spec_name: setting_schema(declared, default_of(f))
            for f, declared in settings_of(config_type)
            if declared.crd is not None and declared.crd.section == section}
