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
