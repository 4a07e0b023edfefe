"""``--structured-outputs-config``: vLLM 0.32's JSON for structured outputs
(``vllm/config/structured_outputs.py``), read alike, or key by key
(``--structured-outputs-config.backend guidance``, ``dotted_args.py``).

    --structured-outputs-config '{"backend": "guidance", "disable_any_whitespace": true}'

kvledger's grammars are llguidance's, the engine of vLLM's ``guidance`` backend, and it
serves every backend name with it (``sampling/json_grammar.py`` writes each one's JSON):

- ``auto`` and ``guidance``: llguidance as vLLM's guidance backend drives it (objects take
  the keys their schema allows: any unless ``additionalProperties`` says; any whitespace).
- ``xgrammar``, ``outlines``, ``lm-format-enforcer``: the same constraints, with each
  library's JSON layout: an object with ``properties`` takes only those keys (xgrammar's
  strict mode, outlines' regex and lm-format-enforcer's parser never write another), and
  whitespace as theirs allows it (xgrammar: any; outlines: at most one space; lm-format-
  enforcer: at most 12 characters in a row). What still differs: kvledger serves what
  those libraries turn away with a 400 (outlines' ``json_object``, a schema keyword
  xgrammar lacks), keeps a schema's own ``additionalProperties`` (outlines' regex drops
  extra keys even then) and its key order (lm-format-enforcer takes any).

``disable_any_whitespace`` (xgrammar and guidance only, as vLLM's validator says) writes
JSON without whitespace; ``disable_additional_properties`` (guidance only) closes objects
as the others do; ``enable_in_reasoning`` applies the output constraint from the first
token under ``--reasoning-parser`` (else it waits for the reasoning's end);
``reasoning_parser`` is ``--reasoning-parser`` (that flag wins when both are given, as in
vLLM: ``EngineArgs.create_structured_outputs_config``). ``reasoning_parser_plugin`` is
refused: kvledger loads no parser code from a file. Values are read as vLLM's pydantic
reads JSON (``"true"`` or ``1`` is a boolean); a key vLLM does not know, or a value it
would refuse, is BadInput naming it (exit 2).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

from kvledger.engine import json_text
from kvledger.engine.errors import BadInput, clip, plain, shown
from kvledger.engine.settings.reasoning_parsers import (
    REASONING_PARSERS,
    REFUSED_REASONING_PARSERS,
)

BACKENDS = ("auto", "xgrammar", "guidance", "outlines", "lm-format-enforcer")
# The backends whose objects take only the keys their schema lists.
CLOSED_OBJECT_BACKENDS = ("xgrammar", "outlines", "lm-format-enforcer")
_FLAG = "--structured-outputs-config"
# The InferenceService's spec.structuredOutputs keys -> vLLM's (reasoningParser is
# spec.reasoningParser already; a plugin is refused).
SPEC_KEYS = {"backend": "backend", "disableAnyWhitespace": "disable_any_whitespace",
             "disableAdditionalProperties": "disable_additional_properties",
             "enableInReasoning": "enable_in_reasoning"}
# pydantic's lax booleans (vLLM reads the flag with TypeAdapter.validate_json), any case.
_TRUE = frozenset({"1", "on", "t", "true", "y", "yes"})
_FALSE = frozenset({"0", "off", "f", "false", "n", "no"})
_BOOLEANS = frozenset({"disable_any_whitespace", "disable_additional_properties",
                       "enable_in_reasoning"})


@dataclass(frozen=True)
class StructuredOutputsConfig:
    """vLLM's fields and defaults, checked when made (BadInput, one line)."""

    backend: str = "auto"
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    reasoning_parser: str = ""
    reasoning_parser_plugin: str = ""
    enable_in_reasoning: bool = False

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise BadInput(f"{_FLAG}: backend must be one of {', '.join(BACKENDS)}, got "
                           f"{shown(self.backend)}")
        for name in sorted(_BOOLEANS):
            if not isinstance(getattr(self, name), bool):
                raise BadInput(f"{_FLAG}: {name} must be true or false, got "
                               f"{shown(getattr(self, name))}")
        for name in ("reasoning_parser", "reasoning_parser_plugin"):
            if not isinstance(getattr(self, name), str):
                raise BadInput(f"{_FLAG}: {name} must be a string, got "
                               f"{shown(getattr(self, name))}")
        # vLLM's model validator, its words.
        if self.disable_any_whitespace and self.backend not in ("xgrammar", "guidance"):
            raise BadInput(f"{_FLAG}: disable_any_whitespace is only supported for xgrammar "
                           f"and guidance backends (backend is {self.backend})")
        if self.disable_additional_properties and self.backend != "guidance":
            raise BadInput(f"{_FLAG}: disable_additional_properties is only supported for "
                           f"the guidance backend (backend is {self.backend})")
        if self.reasoning_parser_plugin:
            raise BadInput(f"{_FLAG}: reasoning_parser_plugin "
                           f"{plain(self.reasoning_parser_plugin)}: "
                           "kvledger does not support loading a reasoning parser from a "
                           "file: it runs no code but its own (--reasoning-parser names "
                           "the parsers it serves)")
        name = self.reasoning_parser
        if name and name not in REASONING_PARSERS:
            why = REFUSED_REASONING_PARSERS.get(name)
            raise BadInput(f"{_FLAG}: reasoning_parser {plain(name)}: kvledger does not "
                           "support that reasoning parser" + (f": {why}" if why else
                                                              " (--help lists those it has)"))

    @property
    def closes_objects(self) -> bool:
        """Whether an object with ``properties`` takes only those keys (where its schema
        does not say otherwise): the closed-object backends, or guidance told to."""
        return self.backend in CLOSED_OBJECT_BACKENDS or self.disable_additional_properties

    @classmethod
    def parse(cls, text: str) -> StructuredOutputsConfig:
        """The flag's JSON object (argparse's type)."""
        try:
            given = json_text.loads(text)  # a RecursionError is a ValueError here too
        except ValueError as exc:
            raise BadInput(f"{_FLAG} {clip(text)}: expected a JSON object of vLLM's "
                           f"structured outputs config ({exc})") from None
        return cls.of(given)

    @classmethod
    def of(cls, given: Any) -> StructuredOutputsConfig:
        """A mapping of vLLM's keys (the flag's JSON, or Python's), read as vLLM reads
        them."""
        if not isinstance(given, Mapping):
            raise BadInput(f"{_FLAG}: expected a JSON object, e.g. '{{\"backend\": "
                           f"\"guidance\"}}', got {shown(given)}")
        known = [f.name for f in fields(cls)]
        unknown = sorted(str(key) for key in given if key not in known)
        if unknown:
            raise BadInput(f"{_FLAG}: vLLM 0.32's structured outputs config has no key "
                           f"{shown(unknown[0])} (its keys: {', '.join(known)})")
        return cls(**{key: _lax_bool(value) if key in _BOOLEANS else value
                      for key, value in given.items()})

    @classmethod
    def from_spec(cls, given: Any) -> StructuredOutputsConfig:
        """``spec.structuredOutputs`` (the CRD's names, ``SPEC_KEYS``)."""
        if not isinstance(given, Mapping):
            raise BadInput(f"spec.structuredOutputs must be an object, got {shown(given)}")
        unknown = sorted(str(key) for key in given if key not in SPEC_KEYS)
        if unknown:
            raise BadInput(f"spec.structuredOutputs has no field {shown(unknown[0])} (its "
                           f"fields: {', '.join(SPEC_KEYS)})")
        return cls.of({SPEC_KEYS[key]: value for key, value in given.items()})

    def to_json(self) -> str:
        """The flag's value that gives this config back: the keys set, vLLM's names."""
        default = StructuredOutputsConfig()
        return json.dumps({key: value for key, value in asdict(self).items()
                           if value != getattr(default, key)}, separators=(",", ":"))

    def __str__(self) -> str:
        return self.to_json()


def _lax_bool(value: Any) -> Any:
    """pydantic's reading of a boolean: true/false, 0/1 and the words of ``_TRUE`` and
    ``_FALSE``; anything else as it is (refused by the check)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int | float) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.lower() in _TRUE | _FALSE:
        return value.lower() in _TRUE
    return value
