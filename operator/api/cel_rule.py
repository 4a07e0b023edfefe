"""One cross-field rule of the spec, held twice: as CEL, which the API server evaluates
(the CRD's ``x-kubernetes-validations``), and as the same verdict in Python, for
``kvledger run`` and an API server older than CEL validation (``spec_rules`` lists them).

A rule's ``path`` is the schema node it sits on, under ``spec`` (``""``: the spec itself;
``a.b``: field b of field a; ``a[]``: each item of the list a); ``nodes`` finds the values
it applies to in a spec as written.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Rule:
    path: str
    cel: str
    message: str
    holds: Callable[[Any], bool]  # the CEL's verdict, in Python, on the same node
    # For a rule on a list's items, what names the item refused (the API server names only
    # its index): a CEL string expression and the same in Python. The refusal is the
    # subject, ': ', then the message (the CRD's messageExpression).
    subject: tuple[str, Callable[[Any], str]] | None = None

    def message_expression(self) -> str | None:
        """The CEL of the refusal naming the item (None without a subject); ``message``
        stays the API server's fallback."""
        if self.subject is None:
            return None
        return f"{self.subject[0]} + ': ' + {json.dumps(self.message)}"

    def refusal(self, node: Any) -> str:
        """The refusal of ``node``, as the CRD's messageExpression words it."""
        return self.message if self.subject is None else f"{self.subject[1](node)}: {self.message}"


def nodes(spec: Mapping[str, Any], path: str) -> Iterator[Any]:
    """The values of ``spec`` a rule at ``path`` applies to (none where a field is unset)."""
    found: list[Any] = [spec]
    for part in path.split(".") if path else ():
        name = part.removesuffix("[]")
        found = [node[name] for node in found if isinstance(node, Mapping) and name in node]
        if part.endswith("[]"):
            found = [item for node in found if isinstance(node, list) for item in node]
    yield from found
