"""The output constraint a request body asks for: OpenAI's ``response_format``, vLLM's
``structured_outputs`` and its older ``guided_*`` fields, read as one ``(kind, value,
layout)`` (``GrammarSpec``'s fields, compiled by ``sampling/grammar.py``). At most one may
be given; a malformed one is a 400 naming its field.

``structured_outputs`` takes every field of vLLM 0.32's ``StructuredOutputsParams``: one
constraint (``json``, ``regex``, ``choice``, ``grammar``, ``json_object``,
``structural_tag``) and the JSON layout options (``disable_any_whitespace``,
``disable_additional_properties``, ``whitespace_pattern``), which apply to this request
(``sampling/json_grammar.py``). ``response_format`` of type ``structural_tag`` takes
vLLM's ``structures``/``triggers`` form; its newer ``format`` form is xgrammar's own
language, refused by name.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field

from kvledger.engine import json_text
from kvledger.engine.sampling.json_grammar import JsonLayout
from kvledger.engine.server.validation import Refusal, Strict

# The fields that constrain the output, in the order a refusal names them.
CONSTRAINT_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex",
                     "guided_choice", "guided_grammar")
# What a constraint is as the compiler takes it: GrammarSpec's kind, value and layout.
Constraint = tuple[str, str | None, JsonLayout | None]


class JsonSchemaFormat(Strict):
    name: str = "response"
    schema_: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None


class TaggedStructure(Strict):
    """One structure of a structural tag: ``begin``, a value of ``schema``, ``end``."""

    begin: str
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    end: str


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None
    structures: list[TaggedStructure] | None = None  # structural_tag's
    triggers: list[str] | None = None
    format: Any = None  # vLLM's newer structural_tag form: refused by name


class StructuredOutputs(Strict):
    """vLLM's ``structured_outputs``: one of these constraints, and the layout options."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: dict[str, Any] | str | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None

    def layout(self) -> JsonLayout | None:
        layout = JsonLayout(self.disable_any_whitespace, self.disable_additional_properties,
                            self.whitespace_pattern)
        return None if layout == JsonLayout() else layout


def output_constraint(req: Any) -> Constraint | None:
    """The one constraint a validated request gives, as ``(kind, value, layout)``, or
    None; a ``Refusal`` (400) when it gives more than one or a malformed one."""
    constraints = [name for name in CONSTRAINT_FIELDS if getattr(req, name) is not None]
    fmt = req.response_format
    if fmt is not None and fmt.type == "text":
        constraints.remove("response_format")
    if len(constraints) > 1:
        raise Refusal(f"only one output constraint may be given, got "
                      f"{', '.join(constraints)}", constraints[1])
    if fmt is not None and fmt.type == "json_object":
        return "json_object", None, None
    if fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None:
            raise Refusal("'response_format' of type json_schema needs 'json_schema': "
                          "{\"name\": ..., \"schema\": {...}}", "response_format")
        return "json_schema", _schema_text(fmt.json_schema.schema_, "response_format"), None
    if fmt is not None and fmt.type == "structural_tag":
        return (*_structural_tag(fmt), None)
    so = req.structured_outputs
    if so is None:
        spec = _spec(req.guided_json, req.guided_regex, req.guided_choice, req.guided_grammar,
                     ("guided_json", "guided_regex", "guided_choice"))
        return None if spec is None else (*spec, None)
    given = [k for k in ("json_", "regex", "choice", "grammar", "json_object", "structural_tag")
             if getattr(so, k)]
    if len(given) != 1:
        raise Refusal("'structured_outputs' must hold exactly one of json, regex, choice, "
                      "grammar, json_object or structural_tag", "structured_outputs")
    if so.structural_tag is not None:
        return "structural_tag", _tag_text(so.structural_tag), so.layout()
    spec = _spec(so.json_, so.regex, so.choice, so.grammar, ("structured_outputs",) * 3)
    return (*(spec or ("json_object", None)), so.layout())


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
          grammar: str | None, fields: tuple[str, str, str]) -> tuple[str, str | None] | None:
    """The one constraint given among a JSON schema, a regex, a choice list and a grammar,
    or None."""
    if schema is not None:
        return "json_schema", _schema_text(schema, fields[0])
    if regex is not None:
        return "regex", regex
    if choice is not None:
        return _choice(choice, fields[2])
    if grammar is not None:
        return "grammar", grammar
    return None


def _structural_tag(fmt: ResponseFormat) -> tuple[str, str]:
    if fmt.format is not None:
        raise Refusal("'response_format' of type structural_tag with 'format' is xgrammar's "
                      "structural tag language, which this server does not read; give "
                      "'structures' ({\"begin\", \"schema\", \"end\"}) and 'triggers'",
                      "response_format")
    if not fmt.structures or not fmt.triggers:
        raise Refusal("'response_format' of type structural_tag needs 'structures' and "
                      "'triggers'", "response_format")
    tag = {"structures": [s.model_dump(by_alias=True, exclude_none=True)
                          for s in fmt.structures], "triggers": fmt.triggers}
    return "structural_tag", json.dumps(tag, sort_keys=True)


def _tag_text(tag: dict[str, Any] | str) -> str:
    """``structured_outputs.structural_tag`` (an object or its JSON) as its JSON text."""
    if isinstance(tag, str):
        try:
            tag = json_text.loads(tag)
        except ValueError:
            raise Refusal("'structured_outputs.structural_tag' must be a JSON object",
                          "structured_outputs") from None
    if not isinstance(tag, dict):
        raise Refusal("'structured_outputs.structural_tag' must be a JSON object",
                      "structured_outputs")
    return json.dumps(tag, sort_keys=True)


def _choice(options: list[str], field: str) -> tuple[str, str]:
    if not options or not all(options):
        raise Refusal(f"'{field}' must be a non-empty list of non-empty strings", field)
    return "choice", json.dumps(options)
