"""What safetensors refuses in a header that Python's json accepts, checked as strictly as
its own parser checks it: a field given twice (json keeps the last), ``-0`` where a size
must be (a float to its parser), a name or ``__metadata__`` string with no UTF-8 spelling
(a lone surrogate), ``__metadata__`` other than an object of strings, a field a tensor
does not define. ``safetensors_header`` reads the header; these are the rules it reads by.
"""

from __future__ import annotations

from pathlib import Path

from kvledger.engine import json_text
from kvledger.engine.errors import BadInput
from kvledger.engine.json_stream import MalformedJson

# A tensor's fields, each once. safetensors skips any other field, yet refuses one whose
# value its JSON parser refuses (NaN, 1e400, nesting past 125 levels, a lone surrogate);
# no writer writes one, so another field is refused here rather than checked as it would.
FIELDS = frozenset({"dtype", "shape", "data_offsets"})


def no_duplicate_keys(pairs: list[tuple[str, object]]) -> dict:
    """json's ``object_pairs_hook``: safetensors refuses a field given twice (and a name
    given twice is ambiguous), where json would keep the last."""
    seen: dict = {}
    for key, value in pairs:
        if key in seen:
            raise MalformedJson(f"{key!r} appears twice")
        seen[key] = value
    return seen


def _no_minus_zero(text: str) -> int:
    """json's ``parse_int``: ``-0`` is a float to safetensors' parser, never a size."""
    if text == "-0":
        raise MalformedJson("-0 where a size must be")
    return int(text)


def strict(path: Path, text: str) -> None:
    """BadInput unless ``text`` (the header, or one entry) has no ``-0`` where a size must
    be, as safetensors' JSON parser reads it (a key given twice is refused as the header is
    parsed: ``no_duplicate_keys``). It is parsed again only where a ``-0`` may be: json's
    ``parse_int`` costs a Python call per number, a fifth more of a large header's
    reading."""
    if "-0" not in text:
        return
    try:
        json_text.loads(text, parse_int=_no_minus_zero)
    except ValueError as exc:
        raise BadInput(f"{path}: corrupt safetensors header: {exc}") from None


def utf8(text: str) -> bool:
    """Whether ``text`` has a UTF-8 spelling (json reads ``"\\ud800"``, a lone surrogate,
    that has none; safetensors refuses it)."""
    if text.isascii():
        return True
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def check_metadata(path: Path, metadata: object) -> None:
    """``__metadata__`` is absent, null or an object of strings, as safetensors demands."""
    if metadata is not None and not (
            isinstance(metadata, dict)
            and all(isinstance(v, str) and utf8(k) and utf8(v) for k, v in metadata.items())):
        raise BadInput(f"{path}: corrupt safetensors header: __metadata__ is not an object "
                       "of strings")
