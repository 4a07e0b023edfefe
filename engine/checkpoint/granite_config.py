"""IBM Granite 3.x (``GraniteForCausalLM``, and ``GraniteMoeForCausalLM`` with Mixtral's
experts): a Llama with four scalars, read from
config.json as transformers' ``modeling_granite.py`` applies them:

- ``embedding_multiplier``: the input embeddings times it;
- ``attention_multiplier``: the attention's softmax scale, in place of 1/sqrt(head_dim);
- ``residual_multiplier``: each attention's and each MLP's output times it, before it is
  added to the residual stream;
- ``logits_scaling``: the logits divided by it.

Each defaults to 1.0, as in ``GraniteConfig``. Torch-free: the engine's ``ModelConfig``
holds the numbers, its layers apply them (``model/transformer.py``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from kvledger.engine.errors import BadInput, shown

GRANITE_ARCHITECTURES = ("GraniteForCausalLM", "GraniteMoeForCausalLM")
# config.json's names -> ModelConfig's fields.
_FIELDS = {"embedding_multiplier": "embedding_multiplier",
           "attention_multiplier": "attention_scale",
           "residual_multiplier": "residual_multiplier",
           "logits_scaling": "logits_scaling"}


def granite_fields(raw: Mapping[str, Any], architecture: str) -> dict[str, float]:
    """``ModelConfig``'s multiplier fields for ``architecture`` (empty but for Granite:
    the other families keep the neutral defaults); BadInput naming a multiplier that is
    not a positive finite number (0 or NaN would turn every logit into 0 or NaN)."""
    if architecture not in GRANITE_ARCHITECTURES:
        return {}
    fields = {}
    for key, field in _FIELDS.items():
        value = raw.get(key)
        value = 1.0 if value is None else value
        number = float(value) if isinstance(value, int | float) and not isinstance(
            value, bool) else math.nan
        if not 0.0 < number < math.inf:
            raise BadInput(f"config.json {key!r} must be a positive number, got {shown(value)}")
        fields[field] = number
    return fields
