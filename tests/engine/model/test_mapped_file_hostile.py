"""Hostile safetensors files, differentially against safetensors itself: a checkpoint is
whatever hub repo a tenant names. Every mutant of a valid file is either refused with
BadInput (and nothing else), or accepted only where ``safe_open`` accepts it too, with the
same names and, for every dtype torch holds, the same bytes; no read leaves the file.
KVLEDGER_FUZZ_EXAMPLES hunts harder; KVLEDGER_FUZZ_LOG names a file that collects the
mutants ours refuses but safetensors reads (allowed: stricter, never laxer)."""

import json
import os
import struct
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save

from kvledger.engine import json_stream
from kvledger.engine.checkpoint.safetensors_header import DTYPE_BITS
from kvledger.engine.errors import BadInput
from kvledger.engine.model.mapped_file import MappedFile

FUZZ = settings(max_examples=int(os.environ.get("KVLEDGER_FUZZ_EXAMPLES", "300")),
                deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


class Obj(list):
    """A JSON object as its (key, value) pairs: duplicates survive a round trip."""


class Raw(str):
    """JSON text written as is (NaN, -0, 1e400, nesting no Python value spells)."""


_X = torch.randn(2, 3, generator=torch.Generator().manual_seed(0))
BASE = save({"w.f32": _X, "w.bf16": _X.to(torch.bfloat16), "ids": torch.arange(3),
             "mask": _X > 0, "fp8": _X.to(torch.float8_e4m3fn), "scalar": torch.tensor(1.5),
             "empty": torch.empty(0, 4, dtype=torch.float16), "名前": torch.arange(5.0)},
            metadata={"format": "pt"})
BASE_TEXT, BASE_DATA = BASE[8:8 + (_N := struct.unpack("<Q", BASE[:8])[0])], BASE[8 + _N:]
BASE_NAMES = sorted(set(json.loads(BASE_TEXT)) - {"__metadata__"})


def _dumps(value, ascii_only: bool) -> str:
    if isinstance(value, Obj):
        return "{" + ",".join(f"{_dumps(k, ascii_only)}:{_dumps(v, ascii_only)}"
                              for k, v in value) + "}"
    if isinstance(value, list):
        return "[" + ",".join(_dumps(v, ascii_only) for v in value) + "]"
    return value if isinstance(value, Raw) else json.dumps(value, ensure_ascii=ascii_only)


WEIRD = st.sampled_from([-1, 2**63, 2**64, 10**30, 1.0, 0.5, "1", None, True, [], Obj(),
                         Raw("-0"), Raw("NaN"), Raw("1e400"), Raw("[" * 200 + "]" * 200),
                         Raw("9" * 5000)])  # past int()'s 4,300 digits: a bare ValueError
NUMBER = st.integers(-2, 60) | WEIRD
SHAPE = st.lists(NUMBER, max_size=3) | st.sampled_from(
    [[0, 2**64], [2**62, 8, 0], [0, 2**62, 8], [0, 2**63 - 1, 2], [Raw("-0")], [1] * 70])
DTYPE = st.sampled_from([*DTYPE_BITS, "Q4", "f32", "bf16", "", 5, None, ["F32"], Obj()])
FIELDS = {"data_offsets": st.lists(NUMBER, min_size=1, max_size=3) | NUMBER,
          "shape": SHAPE | NUMBER, "dtype": DTYPE}
NAME = st.text(st.characters(exclude_categories=()), max_size=4) | st.just("__metadata__")


def _set(entry: Obj, key: str, value) -> None:  # the first such field, or a new one
    at = next((i for i, (k, _) in enumerate(entry) if k == key), len(entry))
    entry[at:at + 1] = [(key, value)]


def _mutate(draw, header: Obj) -> object:
    """One change to ``header``, in place (the first four keep it valid: a reshape, a dtype
    of the same width, two tensors' bytes swapped, the entries reordered), or a new
    top-level value."""
    entries = [i for i, (k, v) in enumerate(header) if k != "__metadata__" and
               isinstance(v, Obj) and v]
    if not entries:
        return draw(NUMBER)
    i, j = draw(st.sampled_from(entries)), draw(st.sampled_from(entries))
    (name, entry), other = header[i], header[j][1]
    fields = dict(entry)
    kind = draw(st.sampled_from(["reshape", "retype", "swap", "reorder", "value", "value",
                                 "field", "entry", "name", "duplicate", "drop", "metadata",
                                 "top"]))
    if kind == "reshape" and isinstance(shape := fields.get("shape"), list):
        _set(entry, "shape", draw(st.permutations(shape + [1] * draw(st.integers(0, 2)))))
    elif kind == "retype" and (bits := DTYPE_BITS.get(str(fields.get("dtype")))):
        _set(entry, "dtype", draw(st.sampled_from([d for d in DTYPE_BITS
                                                   if DTYPE_BITS[d] == bits])))
    elif kind == "swap":  # valid where the two are the same size
        _set(entry, "data_offsets", dict(other).get("data_offsets"))
        _set(other, "data_offsets", fields.get("data_offsets"))
    elif kind == "reorder":
        header[:] = draw(st.permutations(header))
    elif kind == "value":
        key = draw(st.sampled_from(list(FIELDS)))
        _set(entry, key, draw(FIELDS[key]))
    elif kind == "field":  # a field given twice (JSON keeps the last), or an unknown one
        entry.insert(0, draw(st.sampled_from(entry) | st.tuples(st.just("x"), NUMBER)))
    elif kind in ("entry", "name"):
        header[i] = (name, draw(NUMBER)) if kind == "entry" else (draw(NAME), entry)
    elif kind == "duplicate":
        header.append((name, Obj(entry)))
    elif kind == "drop":
        del header[i]
    elif kind == "metadata":
        value = draw(st.builds(lambda v: Obj([("k", v)]), NUMBER | st.just("v")) | NUMBER)
        header.insert(draw(st.sampled_from([0, len(header)])), ("__metadata__", value))
    elif kind == "top":
        return draw(NUMBER | st.just(Raw("{" * 3000 + "}" * 3000)))
    return header


@st.composite
def mutants(draw, damage=("structure", "bytes", "length", "data")) -> bytes:
    """A valid file damaged in one or two ways: its header's structure, its header's bytes,
    the length field, the data region's size. A quarter are padded past json_stream's window,
    so read member by member whatever READERS says."""
    kinds = draw(st.sets(st.sampled_from(damage), min_size=1, max_size=2))
    header: object = json.loads(BASE_TEXT, object_pairs_hook=Obj)
    for _ in range(draw(st.integers(1, 3)) if "structure" in kinds else 0):
        header = _mutate(draw, header) if isinstance(header, Obj) else header
    raw = bytearray(_dumps(header, draw(st.booleans())).encode("utf-8", "surrogatepass"))
    for _ in range(draw(st.integers(1, 3)) if "bytes" in kinds else 0):
        at = draw(st.integers(0, len(raw)))
        byte = draw(st.integers(0, 255) | st.sampled_from(b'{}[]",:-0 \\'))
        op = draw(st.sampled_from(["flip", "insert", "delete"]))
        raw[at:at + (op != "insert")] = b"" if op == "delete" else bytes([byte])
    raw += b" " * draw(st.sampled_from([0, 0, 3, json_stream.MEMBER_MAX_CHARS + 1]))
    length = len(raw)
    if "length" in kinds:
        length = draw(st.integers(max(0, length - 9), length + 9)
                      | st.sampled_from([0, 10**8, 10**8 + 1, 2**63, 2**64 - 1]))
    data = BASE_DATA
    if "data" in kinds:
        cut = draw(st.integers(-len(BASE_DATA), 9))
        data = BASE_DATA[:cut] if cut < 0 else BASE_DATA + b"\x7f" * cut
    return struct.pack("<Q", length) + bytes(raw) + data


# json_stream's settings per way of reading: as shipped, member by member, and in 7-byte
# chunks (splitting UTF-8 sequences and tokens) with a 200-character window.
READERS = {"as-is": {"WHOLE_MAX_CHARS": json_stream.WHOLE_MAX_CHARS},
           "member-by-member": {"WHOLE_MAX_CHARS": 0},
           "tiny-window": {"WHOLE_MAX_CHARS": 0, "CHUNK_BYTES": 7, "MEMBER_MAX_CHARS": 200}}


def _mapped(path, reader: str) -> MappedFile:
    with mock.patch.multiple(json_stream, **READERS[reader]):
        return MappedFile(path)


def _bytes(tensor: torch.Tensor) -> bytes:
    """Every byte of a tensor, read (a view past the file's end would SIGBUS here)."""
    return tensor.reshape(-1).view(torch.uint8).numpy().tobytes()


def _write(tmp_path_factory, content: bytes):
    path = tmp_path_factory.getbasetemp() / "hostile.safetensors"
    path.unlink(missing_ok=True)  # a new file: an earlier map of the old one stays whole
    path.write_bytes(content)
    return path


def _safetensors_reads(path) -> bool:
    try:  # SafetensorError, or torch refusing the tensor it builds
        with safe_open(str(path), "pt") as f:
            return all(f.get_tensor(name) is not None for name in f.keys())  # noqa: SIM118
    except Exception:
        return False


@FUZZ
@given(content=mutants(), reader=st.sampled_from(list(READERS)))
def test_a_mutant_is_bad_input_or_exactly_what_safetensors_reads(tmp_path_factory, content,
                                                                 reader):
    """Refused with BadInput, or read: then safetensors reads it too, with the same names,
    and every tensor (but a dtype torch has none of) has the same dtype, shape and bytes."""
    path = _write(tmp_path_factory, content)
    try:
        mapped = _mapped(path, reader)
    except BadInput:
        if _safetensors_reads(path) and (log := os.environ.get("KVLEDGER_FUZZ_LOG")):
            with open(log, "a") as out:
                out.write(f"{reader}\t{content[:400]!r}\n")
        return
    try:
        theirs = safe_open(str(path), "pt")
    except Exception as exc:
        pytest.fail(f"accepted a file safetensors refuses ({exc}): {content[:400]!r}")
    with theirs as f:
        assert sorted(mapped.names) == sorted(f.keys())
        for name in mapped.names:
            try:
                got = mapped.tensor(name)
            except BadInput as exc:  # only a dtype torch holds no tensors of
                assert "holds no tensors of" in str(exc)
                continue
            want = f.get_tensor(name)
            assert (got.dtype, got.shape) == (want.dtype, want.shape), name
            assert _bytes(got) == _bytes(want), name


@FUZZ
@given(content=mutants(damage=("length", "data")))
def test_a_file_cut_short_or_mislengthed_is_refused_and_never_read_past(tmp_path_factory,
                                                                        content):
    """Only the length field and the data region's size changed: a file is accepted only
    with a data region of the size its header declares, and every view is then read."""
    path = _write(tmp_path_factory, content)
    try:
        mapped = _mapped(path, "as-is")
    except BadInput:
        return
    (length,) = struct.unpack("<Q", content[:8])
    assert len(content) - 8 - length == len(BASE_DATA), "accepted a data region cut or grown"
    for name in mapped.names:
        _bytes(mapped.tensor(name))


def test_the_unmutated_file_is_accepted_by_every_reader(tmp_path_factory):
    """The mutants' base is read whole, member by member and in tiny windows alike (were
    it refused, the differential test above would pass vacuously)."""
    path = _write(tmp_path_factory, BASE)
    for reader in READERS:
        assert sorted(_mapped(path, reader).names) == BASE_NAMES


def _file(dtype='"U8"', shape="[1]", offsets="[0,1]", data=b"x", name='"a"', before="",
          inside="", after="") -> bytes:
    """A one-tensor file, its header's text spliced."""
    raw = (f'{{{before}{name}:{{{inside}"dtype":{dtype},"shape":{shape},'
           f'"data_offsets":{offsets}{after}}}}}').encode("utf-8", "surrogatepass")
    return struct.pack("<Q", len(raw)) + raw + data


@pytest.mark.parametrize("content", [
    _file(shape="[2]", offsets="[0,2]"),  # past the end: the concrete case the fuzz relies on
    _file(dtype='["U8"]'),
    _file(shape="[0,18446744073709551616]", offsets="[0,0]", data=b""),
    _file(shape="[4611686018427387904,8,0]", offsets="[0,0]", data=b""),
    _file(shape="[-0]", offsets="[0,0]", data=b""),
    _file(inside='"dtype":"F32",'),  # a field given twice: JSON keeps the last
    _file(before='"__metadata__":{"k":1},'),
    _file(before='"__metadata__":{},"__metadata__":{},'),
    _file(before='"a":0,'),  # a name twice, the first no tensor: JSON keeps the last (CI's fuzz)
    _file(before='"a":{"x":1},'),
    _file(name='"\\ud800"'),  # a lone surrogate: no UTF-8 spells it
    _file(after=',"x":NaN'),
    _file(after=',"x":' + "[" * 200 + "]" * 200),
    _file(shape="[" + "9" * 5000 + "]"),
    _file(offsets="[0," + "9" * 5000 + "]"),
], ids=["past-end", "dtype-list", "dim-2**64", "shape-overflow", "minus-zero", "twice",
        "metadata-int", "metadata-twice", "name-twice-first-not-a-tensor",
        "name-twice-first-unknown-field", "surrogate", "nan", "nested-200", "dim-5000-digits",
        "offset-5000-digits"])
@pytest.mark.parametrize("reader", list(READERS))
def test_a_file_safetensors_refuses_is_bad_input(tmp_path_factory, content, reader):
    """Each of these safetensors refuses (checked here); ours must too, before a view."""
    path = _write(tmp_path_factory, content)
    assert not _safetensors_reads(path)
    with pytest.raises(BadInput):
        mapped = _mapped(path, reader)
        for name in mapped.names:
            _bytes(mapped.tensor(name))
