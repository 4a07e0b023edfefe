"""A manifest's spec as the renderers take it: tests hold specs as the dicts a manifest
has, the operator's renderers take only the parsed ``ServiceSpec`` (``parse_spec``, once
per event by their caller)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvledger.operator.api.spec import ServiceSpec, parse_spec


def spec_of(spec: ServiceSpec | Mapping[str, Any]) -> ServiceSpec:
    """``spec`` parsed (BadInput as the operator would raise it) unless it already is."""
    return spec if isinstance(spec, ServiceSpec) else parse_spec(spec)


def cel_refusals(spec: Mapping[str, Any]) -> list[str]:
    """What the CRD's rules refuse ``spec`` with at ``kubectl apply`` (a rule's
    messageExpression's words where it has one), rule by rule on every node it applies to
    (the API server evaluates a rule only where its field is set); each CEL verdict checked
    to be the Python check's, and each refusal the one the operator and ``kvledger run``
    give."""
    import celpy

    from kvledger.operator.api.cel_rule import nodes
    from kvledger.operator.api.spec_rules import RULES

    env = celpy.Environment()
    broken = []
    for rule in RULES:
        program = env.program(env.compile(rule.cel))
        for node in nodes(spec, rule.path):
            verdict = bool(program.evaluate({"self": celpy.json_to_cel(node)}))
            assert verdict is bool(rule.holds(node)), (rule.message, node)
            if not verdict:
                words = rule.message
                if (expression := rule.message_expression()) is not None:
                    words = str(env.program(env.compile(expression)).evaluate(
                        {"self": celpy.json_to_cel(node)}))
                assert words == rule.refusal(node)
                broken.append(words)
    return broken
