"""One safetensors file's header, read and validated without touching tensor data.

A safetensors file is ``u64 little-endian N`` + ``N`` bytes of JSON + the data region.
The header maps each tensor name to ``{"dtype", "shape", "data_offsets": [begin, end]}``
with offsets relative to the data region. We validate it at least as strictly as
``safetensors`` does (offsets contiguous from 0 and covering the whole region; each field
once; ``__metadata__`` an object of strings; no shape past 64 bits; names in UTF-8: the
JSON rules in ``safetensors_strict``), so a
file accepted here is one ``safe_open`` can load, and its bytes are exactly the loaded
tensors' (tests/engine/model/test_mapped_file_hostile.py checks it against safetensors on
mutants of a valid file). Stricter where safetensors is lax: a tensor named twice (it
keeps the last), a field it does not define (it skips one, unless the value is JSON its
parser refuses), ``-0`` refused as it refuses it only as a float.

The header is read entry by entry (``json_stream``), never parsed whole: what a header
costs is the records it declares (a ``ReadBudget`` counts them), not what ``json.loads``
would build of up to 100 MB of hostile JSON.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import BinaryIO, NamedTuple

from kvledger.engine.checkpoint.read_limits import ReadBudget
from kvledger.engine.checkpoint.safetensors_strict import (
    FIELDS,
    check_metadata,
    no_duplicate_keys,
    strict,
    utf8,
)
from kvledger.engine.errors import BadInput, shown, some
from kvledger.engine.json_stream import MalformedJson, NotAnObject, ObjectReader

# Bits per element of every dtype safetensors knows (0.4 .. 0.8).
DTYPE_BITS: dict[str, int] = {
    "BOOL": 8, "U8": 8, "I8": 8,
    "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6,
    "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8,
    "I16": 16, "U16": 16, "F16": 16, "BF16": 16,
    "I32": 32, "U32": 32, "F32": 32,
    "I64": 64, "U64": 64, "F64": 64, "C64": 64,
}
_DTYPE_NAMES = {name: name for name in DTYPE_BITS}
# safetensors refuses larger headers; anything bigger is a corrupt length field.
MAX_HEADER_BYTES = 100_000_000
# The largest shape torch can lay out: the product of its dimensions (0 counted as 1, as
# torch's strides do) in an int64, so no dimension of an empty tensor overflows either.
MAX_SPAN = 2**63 - 1


class TensorInfo(NamedTuple):
    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    begin: int = 0  # where its bytes start in the data region (after the header)


def read_safetensors_header(path: str | os.PathLike,
                            budget: ReadBudget | None = None) -> list[TensorInfo]:
    """The tensors one safetensors file holds, from its header alone (validated), counted
    against ``budget`` as they are read."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            return read_open_layout(path, f, budget)[0]
    except OSError as exc:
        raise BadInput(f"cannot read {path}: {exc.strerror or exc}") from None


def read_open_layout(path: Path, f: BinaryIO, budget: ReadBudget | None = None,
                     ) -> tuple[list[TensorInfo], int]:
    """``read_safetensors_header``'s tensors of ``path`` open as ``f`` (at its start;
    OSError as it comes), and where the data region starts in the file (each tensor's
    bytes at that plus its ``begin``): a reader that maps the file goes on with the
    descriptor it checked, not a file put in its place since."""
    file_bytes = os.fstat(f.fileno()).st_size
    prefix = f.read(8)
    if len(prefix) < 8:
        raise BadInput(f"{path}: truncated safetensors file ({file_bytes} bytes, "
                       "no header length)")
    (header_len,) = struct.unpack("<Q", prefix)
    if header_len > MAX_HEADER_BYTES or header_len > file_bytes - 8:
        raise BadInput(f"{path}: corrupt safetensors header: header length "
                       f"{header_len} exceeds the file ({file_bytes} bytes)")
    left = [header_len]

    def read(count: int) -> bytes:
        data = f.read(min(count, left[0]))
        left[0] -= len(data)
        return data

    try:
        # A name or field given twice is refused as it is parsed: safetensors refuses the
        # first value whatever follows it, and a dict would keep only the last.
        reader = ObjectReader(read, object_pairs_hook=no_duplicate_keys)
        header = reader.whole_object()
        if header is not None:  # it fits in one window: parsed at once, as it was
            tensors, spans = _whole_entries(path, header, reader.text())
            if budget is not None:
                budget.take_tensors(len(tensors))
        else:
            tensors, spans = _read_entries(path, reader, budget)
    except NotAnObject as exc:
        raise BadInput(f"{path}: corrupt safetensors header: {exc}") from None
    except MalformedJson as exc:
        raise BadInput(f"{path}: corrupt safetensors header: not valid JSON ({exc})") from None
    _check_offsets(path, spans, file_bytes - 8 - header_len)
    return tensors, 8 + header_len


def _whole_entries(path: Path, header: object, raw: str,
                   ) -> tuple[list[TensorInfo], list[tuple[int, int, str]]]:
    """The tensors and spans of a header parsed whole (the usual case: a header of up to
    ``json_stream.MEMBER_MAX_CHARS``)."""
    if not isinstance(header, dict):
        raise BadInput(f"{path}: corrupt safetensors header: not a JSON object")
    strict(path, raw)
    check_metadata(path, header.get("__metadata__"))
    spans: list[tuple[int, int, str]] = []
    tensors = _fast_tensor_infos(header, spans)
    if tensors is None:  # something is off: the slow path names it
        tensors = [_tensor_info(path, name, entry) for name, entry in header.items()
                   if name != "__metadata__"]
        spans = [(*header[t.name]["data_offsets"], t.name) for t in tensors]
    return tensors, spans


def _fast_tensor_infos(header: dict, spans: list) -> list[TensorInfo] | None:
    """The tensors of a well-formed header (their ``(begin, end, name)`` appended to
    ``spans``), or None at the first anomaly."""
    out = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        info = _fast_tensor_info(name, entry)
        if info is None:
            return None
        out.append(info)
        spans.append((entry["data_offsets"][0], entry["data_offsets"][1], name))
    return out


# Tensors read between two counts against the budget: a header cannot declare more than
# this past the limit before it is refused.
COUNT_EVERY = 1024


def _read_entries(path: Path, reader: ObjectReader, budget: ReadBudget | None,
                  ) -> tuple[list[TensorInfo], list[tuple[int, int, str]]]:
    """The header's tensors and their ``(begin, end, name)`` spans, one entry at a time."""
    tensors: list[TensorInfo] = []
    spans: list[tuple[int, int, str]] = []
    names: set[str] = set()
    reader.begin()
    while (name := reader.key()) is not None:
        entry = reader.value()
        if name in names:
            raise BadInput(f"{path}: corrupt safetensors header: {shown(name)} appears twice")
        names.add(name)
        strict(path, reader.value_text())
        if name == "__metadata__":
            check_metadata(path, entry)
            continue
        info = _fast_tensor_info(name, entry) or _tensor_info(path, name, entry)
        tensors.append(info)
        spans.append((entry["data_offsets"][0], entry["data_offsets"][1], name))
        if budget is not None and len(tensors) % COUNT_EVERY == 0:
            budget.take_tensors(COUNT_EVERY)
    reader.end()
    if budget is not None:
        budget.take_tensors(len(tensors) % COUNT_EVERY)
    return tensors, spans


def _fast_tensor_info(name: str, entry: object) -> TensorInfo | None:
    """The record of a well-formed entry, or None at the first anomaly (``_tensor_info``
    then names it). The hot path: a 70B checkpoint has hundreds of entries."""
    try:
        dtype, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
        bits = DTYPE_BITS[dtype]
    except (TypeError, KeyError, ValueError):
        return None
    if (type(shape) is not list or type(begin) is not int or type(end) is not int
            or len(entry) != 3 or not (name.isascii() or utf8(name))):
        return None
    for d in shape:
        if type(d) is not int or d < 0:
            return None
        bits *= d
    if bits % 8 or bits // 8 != end - begin or begin < 0 or (not bits and _span(shape) > MAX_SPAN):
        return None
    # The dtype's own string: one per dtype, not one per tensor.
    return TensorInfo(name, _DTYPE_NAMES[dtype], tuple(shape), bits // 8, begin)


def _tensor_info(path: Path, name: str, entry: object) -> TensorInfo:
    if not isinstance(entry, dict):
        raise BadInput(f"{path}: corrupt safetensors header: entry {shown(name)} is not an object")
    if not utf8(name):
        raise BadInput(f"{path}: corrupt safetensors header: tensor name {shown(name)} is not "
                       "UTF-8 (a lone surrogate)")
    if unknown := set(entry) - FIELDS:
        raise BadInput(f"{path}: corrupt safetensors header: tensor {shown(name)} has fields "
                       f"safetensors does not define: {some(sorted(unknown))}")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPE_BITS:
        raise BadInput(f"{path}: tensor {shown(name)} has unknown dtype {dtype!r} "
                       f"(known: {', '.join(DTYPE_BITS)})")
    if (not isinstance(shape, list)
            or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
        raise BadInput(f"{path}: tensor {shown(name)} has a bad shape {shape!r}")
    if (not isinstance(offsets, list) or len(offsets) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) and o >= 0 for o in offsets)
            or offsets[0] > offsets[1]):
        raise BadInput(f"{path}: tensor {shown(name)} has bad data_offsets {offsets!r}")
    numel = 1
    for d in shape:
        numel *= d
    bits = numel * DTYPE_BITS[dtype]
    if bits % 8 or bits // 8 != offsets[1] - offsets[0]:
        size = f"{_digits(bits // 8)} bytes" if bits % 8 == 0 else f"{_digits(bits)} bits"
        raise BadInput(f"{path}: tensor {shown(name)} {dtype}{_shape_text(shape)} needs {size} but "
                       f"its data_offsets span {_digits(offsets[1] - offsets[0])}")
    if _span(shape) > MAX_SPAN:
        raise BadInput(f"{path}: tensor {shown(name)} {dtype}{_shape_text(shape)} is larger than "
                       "any tensor can be (its dimensions overflow 64 bits)")
    return TensorInfo(name, dtype, tuple(shape), bits // 8, offsets[0])


def _span(shape: list[int]) -> int:
    """The product of the dimensions, 0 counted as 1 (as torch's strides count it): past
    ``MAX_SPAN`` only for an empty tensor, since a tensor's bytes lie within its file."""
    span = 1
    for d in shape:
        span *= d or 1
    return span


def _digits(n: int) -> str:
    """``n`` in at most 20 characters (a hostile header's numbers have hundreds of digits)."""
    text = str(n)
    return text if len(text) <= 20 else f"{text[:3]}...({len(text)} digits)"


def _shape_text(shape: list[int]) -> str:
    return "[" + ", ".join(_digits(d) for d in shape) + "]"


def _check_offsets(path: Path, spans: list[tuple[int, int, str]], data_bytes: int) -> None:
    """Offsets contiguous from 0 and covering the data region, as safetensors demands."""
    spans.sort()
    position = 0
    for begin, end, name in spans:
        if end > data_bytes:
            raise BadInput(f"{path}: corrupt safetensors header: tensor {shown(name)} ends at byte "
                           f"{end}, past the end of the file's {data_bytes} data bytes "
                           "(truncated file?)")
        if begin != position:
            raise BadInput(f"{path}: corrupt safetensors header: tensor {shown(name)} starts at "
                           f"{begin}, expected {position} (overlap or gap)")
        position = end
    if position != data_bytes:
        raise BadInput(f"{path}: corrupt safetensors file: {data_bytes - position} bytes after "
                       "the last tensor")
