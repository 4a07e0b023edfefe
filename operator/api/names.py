"""What an InferenceService may be named: what can name its children.

The operator names the Deployment (or LeaderWorkerSet), the Service, the HPA, the
NetworkPolicy and the InferencePool as the resource itself, and its ConfigMaps and key
Secret with a suffix (``NAME-sleep``, ``NAME-objectives``, ``NAME-nodes-XXXXX``, DNS-1123
subdomains of up to 253 characters: no limit below the Service's). The Service's name is
the tightest: a DNS-1035 label, at most 63 characters. The API server checks only that a
custom resource's name is a DNS-1123 subdomain, so ``llama-3.1-8b`` was stored, and its
Service failed after its GPU pods started. The webhook and ``kvledger run`` refuse it, in
the same words. Not the CRD: a CEL rule on ``self.metadata.name`` (a string the schema
cannot bound) is costed by the API server at a request's whole size, which may refuse the
CRD itself; and the admission webhook sees every create and update.
"""

from __future__ import annotations

import re
from typing import Any

from kvledger.engine.errors import BadInput, shown

NAME_MAX = 63
NAME_PATTERN = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
NAME_MESSAGE = (
    f"metadata.name must be a DNS-1035 label of at most {NAME_MAX} characters (lowercase "
    "letters, digits and '-', starting with a letter and ending with a letter or digit; no "
    "'.'): the operator names the Service in front of the pods after the resource (write "
    "llama-3-1-8b for llama-3.1-8b)")
# What the API server appends to a generateName: 5 characters of [a-z0-9].
GENERATED_SUFFIX = "x0x0x"


def name_ok(name: Any) -> bool:
    """Whether ``name`` can name the children: a DNS-1035 label of ``NAME_MAX`` at most."""
    return (isinstance(name, str) and len(name) <= NAME_MAX
            and re.fullmatch(NAME_PATTERN[1:-1], name) is not None)


def check_name(name: Any, generate_name: Any = None) -> None:
    """BadInput (``NAME_MESSAGE``, naming the value) for a name that cannot name the
    children; without a name, the names ``generate_name`` gives (its five characters
    added)."""
    if not name and isinstance(generate_name, str) and generate_name:
        if not name_ok(generate_name + GENERATED_SUFFIX):
            raise BadInput(f"metadata.generateName {shown(generate_name)}: {NAME_MESSAGE}")
        return
    if not name_ok(name):
        raise BadInput(f"{shown(name)}: {NAME_MESSAGE}")
