"""What a request constrains its output to (``GrammarSpec``), and the llguidance grammar
text each kind becomes (``grammar_source``); the compiler (``grammar.py``) builds and caches
the matchers.

Kinds, as vLLM 0.32's ``StructuredOutputsParams`` names them: ``json_schema`` (its
``json``), ``json_object``, ``regex``, ``choice``, ``grammar`` (a context-free grammar in
Lark or GBNF/EBNF form, ``root ::= ...``: llguidance's ``grammar_from("grammar")``, what
vLLM's guidance backend compiles it with), ``structural_tag`` (free text in which each
trigger starts a tagged JSON structure: ``begin``, a value of its schema, ``end``; vLLM's
triggers-and-structures form) and ``lark`` (tool calls' grammars, written by the server).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from kvledger.engine import json_text
from kvledger.engine.errors import BadConstraint
from kvledger.engine.sampling.json_grammar import JsonLayout, json_schema_source, laid_out_schema
from kvledger.engine.settings.structured_outputs_config import StructuredOutputsConfig

_MESSAGE_LIMIT = 200


class GrammarError(BadConstraint):
    """A grammar the library refuses (bad schema, regex or choice list); HTTP 400."""


class GrammarTooCostly(GrammarError):
    """A grammar over one of the server's limits (compile time, memory); HTTP 400."""

    costly = True


@dataclass(frozen=True)
class GrammarSpec:
    """What to constrain the output to. ``value``: json_schema: the schema as a JSON string
    (sorted keys, so equal schemas hash equal); regex: the pattern; choice: ``json.dumps`` of
    a list of strings; grammar: the grammar's text; structural_tag: ``json.dumps`` of
    ``{"structures": [{"begin", "schema", "end"}], "triggers": [...]}``; lark: a grammar in
    llguidance's Lark dialect (tool calls); json_object: None. ``layout``: the request's
    own JSON options (None: the server's)."""

    kind: Literal["json_object", "json_schema", "regex", "choice", "grammar", "structural_tag",
                  "lark"]
    value: str | None = None
    layout: JsonLayout | None = None


def grammar_source(spec: GrammarSpec, structured_outputs: StructuredOutputsConfig) -> str:
    """The llguidance grammar of ``spec`` (JSON written as ``structured_outputs`` and the
    spec's layout say: ``json_grammar.py``); GrammarError for a malformed value."""
    import llguidance
    from llguidance import LLMatcher

    if spec.kind == "json_object":
        return json_schema_source({"type": "object"}, structured_outputs, spec.layout)
    if spec.value is None:
        raise GrammarError(f"{spec.kind} needs a value")
    if spec.kind == "json_schema":
        return _schema_source(_json_value(spec.value, "json_schema"), structured_outputs,
                              spec.layout, "json_schema")
    if spec.kind == "regex":
        return LLMatcher.grammar_from_regex(spec.value)
    if spec.kind == "lark":
        return LLMatcher.grammar_from_lark(spec.value)
    if spec.kind == "grammar":
        try:
            return llguidance.grammar_from("grammar", spec.value)
        except ValueError as exc:  # not Lark, and not GBNF either
            raise GrammarError(f"invalid grammar: {one_line(str(exc))}") from None
    if spec.kind == "structural_tag":
        return _structural_tag_source(_json_value(spec.value, "structural_tag"),
                                      structured_outputs, spec.layout)
    if spec.kind == "choice":
        choices = _json_value(spec.value, "choice")
        if not (isinstance(choices, list) and choices
                and all(isinstance(c, str) and c for c in choices)):
            raise GrammarError("invalid choice: expected a non-empty list of non-empty strings")
        return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))
    raise GrammarError(f"unknown grammar kind {spec.kind!r}")


def _schema_source(schema: Any, config: StructuredOutputsConfig, layout: JsonLayout | None,
                   what: str) -> str:
    if not isinstance(schema, dict | bool):
        raise GrammarError(f"invalid {what}: a schema is an object or a boolean, "
                           f"not {type(schema).__name__}")
    try:
        return json_schema_source(schema, config, layout)
    except ValueError as exc:
        raise GrammarError(f"invalid {what}: {one_line(str(exc))}") from None


def _structural_tag_source(tag: Any, config: StructuredOutputsConfig,
                           layout: JsonLayout | None) -> str:
    """Free text in which a trigger starts one of the structures (llguidance's
    ``StructTag``, as vLLM's guidance backend builds it); each structure's begin must start
    with one of the triggers."""
    from llguidance import StructTag

    what = "invalid structural_tag"
    structures = tag.get("structures") if isinstance(tag, dict) else None
    triggers = tag.get("triggers") if isinstance(tag, dict) else None
    if not (isinstance(structures, list) and structures and isinstance(triggers, list)
            and triggers and all(isinstance(t, str) and t for t in triggers)):
        raise GrammarError(f"{what}: expected {{\"structures\": [{{\"begin\", \"schema\", "
                           f"\"end\"}}, ...], \"triggers\": [non-empty strings]}}")
    tags = []
    for structure in structures:
        begin, end = (structure.get(k) if isinstance(structure, dict) else None
                      for k in ("begin", "end"))
        if not (isinstance(begin, str) and isinstance(end, str)):
            raise GrammarError(f"{what}: each structure needs a begin and an end string")
        trigger = next((t for t in triggers if begin.startswith(t)), None)
        if trigger is None:
            raise GrammarError(f"{what}: begin {json.dumps(begin)[:80]} starts with none of "
                               f"the triggers")
        schema = structure.get("schema", True)
        _schema_source(schema, config, layout, "structural_tag schema")  # refused here
        # The schema itself: a compiled grammar in its place would be read as a schema of
        # unknown keywords, which takes any JSON.
        tags.append(StructTag(trigger=trigger, begin=begin, end=end,
                              grammar=laid_out_schema(schema, config, layout)))
    return StructTag.to_grammar(tags)


def _json_value(text: str, kind: str) -> Any:
    try:
        return json_text.loads(text)
    except ValueError as exc:
        raise GrammarError(f"invalid {kind}: not JSON: {exc}") from None


def one_line(message: str) -> str:
    """The library's message on one line, whitespace collapsed, at most 200 characters."""
    line = " ".join(message.split()) or "refused"
    return line if len(line) <= _MESSAGE_LIMIT else line[:_MESSAGE_LIMIT - 1] + "…"
