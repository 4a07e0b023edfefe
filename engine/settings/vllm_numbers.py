"""vLLM's human-readable token counts: ``--max-model-len 32k`` as ``vllm serve`` reads it
(vLLM 0.32's ``human_readable_int``, vllm/utils/argparse_utils.py), for the flags vLLM reads
so (``--max-model-len``, ``--max-num-batched-tokens``).

A lowercase suffix is decimal (``k`` 1,000, ``m`` 10**6, ``g`` 10**9, ``t`` 10**12) and may
follow a decimal number (``25.6k`` is 25,600); an uppercase one is binary (``K`` 1,024,
``M`` 2**20, ``G`` 2**30, ``T`` 2**40) and takes whole numbers only. A plain integer is
itself. vLLM's ``-1``/``auto`` for ``--max-model-len`` (the longest context the KV memory
holds) is refused by name: kvledger plans the context it is given.
"""

from __future__ import annotations

import re

from kvledger.engine.errors import BadInput

_COUNT = re.compile(r"(\d+(?:\.\d+)?)([kKmMgGtT])")
_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
FORMS = "e.g. 32768, 32k (32,000), 32K (32,768) or 25.6k"


def human_readable_int(text: str) -> int:
    """The count ``text`` names, as vLLM reads it; BadInput (one line) for anything else."""
    value = text.strip()
    if value.lower() in ("auto", "-1"):
        raise BadInput(f"{text!r} (vLLM's longest context that fits) is not supported: leave "
                       "the flag out for the model's own context, or give a count; `kvledger "
                       "plan` shows what fits")
    match = _COUNT.fullmatch(value)
    if match is None:
        try:
            return int(value)
        except ValueError:
            raise BadInput(f"expected a count of tokens, {FORMS}; got {text!r}") from None
    number, suffix = match.groups()
    if suffix in _DECIMAL:
        return int(float(number) * _DECIMAL[suffix])
    if "." in number:
        raise BadInput(f"{text!r}: a binary suffix such as {suffix} takes whole numbers; did "
                       f"you mean {number}{suffix.lower()}?")
    return int(number) * _BINARY[suffix]
