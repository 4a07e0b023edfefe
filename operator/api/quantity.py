"""Kubernetes quantities the spec holds: a container's memory limit, an autoscaling target.

The engine's own SIZE grammar (``memory.limit``, ``kvCacheMemoryBytes``) is
``kvledger.engine.settings.kinds.parse_size``'s; these are Kubernetes' (k8s.io/apimachinery
resource.Quantity), which the pod and the HPA read.
"""

from __future__ import annotations

import math
import re
from decimal import Decimal
from fractions import Fraction
from typing import Any

from kvledger.engine.errors import BadInput, shown

# A per-pod target: a whole number, a decimal, or thousandths ("800m"), as a quantity.
TARGET_PATTERN = r"^([0-9]+([.][0-9]+)?|[.][0-9]+|[0-9]+m)$"

# A quantity: a signed decimal number, then a binary (Ki..Ei) or decimal (n, u, m, "", k,
# M..E) suffix or an exponent (e3, E-2).
_QUANTITY_RE = re.compile(r"([+-]?)([0-9]+(?:\.[0-9]*)?|\.[0-9]+)"
                          r"([eE][+-]?[0-9]+|[KMGTPE]i|[numkMGTPE])?")
# The most characters a quantity may have: a byte count is an int64 (19 digits). The CRD's
# int-or-string takes any string: a number of a million digits took the exact arithmetic
# below half a minute (in the operator, on the event loop every tenant shares), and an
# exponent of 5,000 digits raised int()'s ValueError.
MAX_QUANTITY_CHARS = 64
_QUANTITY_SCALE = {
    **{unit: 2 ** (10 * (i + 1)) for i, unit in enumerate(("Ki", "Mi", "Gi", "Ti", "Pi", "Ei"))},
    **{unit: Fraction(10) ** exp for unit, exp in (("n", -9), ("u", -6), ("m", -3), ("", 0),
                                                    ("k", 3), ("M", 6), ("G", 9), ("T", 12),
                                                    ("P", 15), ("E", 18))},
}


def target_value(value: Any) -> Fraction:
    """The exact number an autoscaling target names: ``4``, ``"0.8"``, ``"800m"`` (0 is a
    number here; ``spec_rules`` refuses it). Raises BadInput for anything else."""
    if isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str) or not re.fullmatch(TARGET_PATTERN, value):
        raise BadInput(f"autoscaling.target: {value!r} is not a whole number, a decimal or "
                       "thousandths (4, \"0.8\", \"800m\")")
    if value.endswith("m"):
        return Fraction(int(value[:-1]), 1000)
    return Fraction(Decimal(value))


def quantity_bytes(field: str, value: Any) -> int:
    """Bytes in a Kubernetes memory quantity (``2Gi``, ``2G``, ``2000M``, ``512Mi``,
    ``1e9``, ``1500m``, plain bytes), rounded up to a whole byte as Kubernetes does.
    Raises BadInput naming ``field`` for anything else, or for no bytes at all."""
    text = str(value) if isinstance(value, int) and not isinstance(value, bool) else value
    match = _QUANTITY_RE.fullmatch(text) if isinstance(text, str) else None
    if match is None:
        raise BadInput(f"{field}: {shown(value)} is not a Kubernetes quantity "
                       "(e.g. 2Gi, 2G, 2000M, 512Mi or plain bytes)")
    sign, number, suffix = match.group(1), match.group(2), match.group(3) or ""
    if len(text) > MAX_QUANTITY_CHARS:
        raise BadInput(f"{field}: {shown(value)} is out of range (more than "
                       f"{MAX_QUANTITY_CHARS} characters)")
    if suffix[:1] in ("e", "E") and len(suffix) > 1:
        exponent = int(suffix[1:])
        if abs(exponent) > 30:  # beyond any machine's memory (and Kubernetes' int64)
            raise BadInput(f"{field}: {shown(value)} is out of range")
        scale = Fraction(10) ** exponent
    else:
        scale = _QUANTITY_SCALE[suffix]
    size = math.ceil(Fraction(Decimal(number)) * scale)
    if sign == "-" or size <= 0:
        raise BadInput(f"{field} must be more than 0 bytes, got {shown(value)}")
    return size
