"""The output constraint a request body asks for: OpenAI's ``response_format``, vLLM's
``structured_outputs`` and its older ``guided_*`` fields, read as one ``(kind, value)``
(``GrammarSpec``'s fields, compiled by ``sampling/grammar.py``). At most one may be given;
a malformed one is a 400 naming its field.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field

from kvledger.engine import json_text
from kvledger.engine.server.validation import Refusal, Strict

# The fields that constrain the output, in the order a refusal names them.
CONSTRAINT_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex",
                     "guided_choice")


class JsonSchemaFormat(Strict):
    name: str = "response"
    schema_: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(Strict):
    """vLLM's ``structured_outputs``: one of these constraints."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    json_object: bool | None = None


def output_constraint(req: Any) -> tuple[str, str | None] | None:
    """The one constraint a validated request gives, as ``(kind, value)``, or None; a
    ``Refusal`` (400) when it gives more than one or a malformed one."""
    constraints = [name for name in CONSTRAINT_FIELDS if getattr(req, name) is not None]
    fmt = req.response_format
    if fmt is not None and fmt.type == "text":
        constraints.remove("response_format")
    if len(constraints) > 1:
        raise Refusal(f"only one output constraint may be given, got "
                      f"{', '.join(constraints)}", constraints[1])
    if fmt is not None and fmt.type == "json_object":
        return "json_object", None
    if fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None:
            raise Refusal("'response_format' of type json_schema needs 'json_schema': "
                          "{\"name\": ..., \"schema\": {...}}", "response_format")
        return "json_schema", _schema_text(fmt.json_schema.schema_, "response_format")
    so = req.structured_outputs
    if so is None:
        return _spec(req.guided_json, req.guided_regex, req.guided_choice,
                     ("guided_json", "guided_regex", "guided_choice"))
    given = [k for k in ("json_", "regex", "choice", "json_object") if getattr(so, k)]
    if len(given) != 1:
        raise Refusal("'structured_outputs' must hold exactly one of json, regex, choice "
                      "or json_object", "structured_outputs")
    return _spec(so.json_, so.regex, so.choice, ("structured_outputs",) * 3) \
        or ("json_object", None)


def constraint_field(req: Any) -> str:
    """The field a request's constraint came from, for a refusal of its grammar."""
    return next(name for name in CONSTRAINT_FIELDS if getattr(req, name) is not None)


def _schema_text(schema: dict[str, Any] | str, field: str) -> str:
    if isinstance(schema, str):
        try:
            schema = json_text.loads(schema)
        except ValueError:
            raise Refusal(f"'{field}' must hold a JSON schema object", field) from None
    if not isinstance(schema, dict):
        raise Refusal(f"'{field}' must hold a JSON schema object", field)
    return json.dumps(schema, sort_keys=True, separators=(",", ":"))


def _spec(schema: dict[str, Any] | str | None, regex: str | None, choice: list[str] | None,
          fields: tuple[str, str, str]) -> tuple[str, str | None] | None:
    """The one constraint given among a JSON schema, a regex and a choice list, or None."""
    if schema is not None:
        return "json_schema", _schema_text(schema, fields[0])
    if regex is not None:
        return "regex", regex
    if choice is not None:
        return _choice(choice, fields[2])
    return None


def _choice(options: list[str], field: str) -> tuple[str, str]:
    if not options or not all(options):
        raise Refusal(f"'{field}' must be a non-empty list of non-empty strings", field)
    return "choice", json.dumps(options)
