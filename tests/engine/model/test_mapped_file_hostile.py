"""Hostile safetensors files, differentially against safetensors itself: a checkpoint is
whatever hub repo a tenant names. Every mutant of a valid file is either refused with
BadInput (and nothing else), or accepted only where ``safe_open`` accepts it too, with the
same names and, for every dtype torch holds, the same bytes; no read leaves the file.
KVLEDGER_FUZZ_EXAMPLES hunts harder; KVLEDGER_FUZZ_LOG names a file that collects the
mutants ours refuses but safetensors reads (allowed: stricter, never laxer)."""

import json
import os
import struct
from contextlib import ExitStack
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

EXAMPLES = int(os.environ.get("KVLEDGER_FUZZ_EXAMPLES", "60"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
STRICTER: set[bytes] = set()


class Obj(list):
    """A JSON object as its (key, value) pairs: duplicates survive a round trip."""


class Raw(str):
    """JSON text written as is (NaN, -0, 1e400, nesting no Python value spells)."""


def _base() -> bytes:
    x = torch.randn(2, 3, generator=torch.Generator().manual_seed(0))
    return save({"w.f32": x, "w.bf16": x.to(torch.bfloat16), "ids": torch.arange(3),
                 "mask": x > 0, "fp8": x.to(torch.float8_e4m3fn), "scalar": torch.tensor(1.5),
                 "empty": torch.empty(0, 4, dtype=torch.float16), "名前": torch.arange(5.0)},
                metadata={"format": "pt"})


BASE = _base()
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
                         Raw("-0"), Raw("NaN"), Raw("1e400"), Raw("[" * 200 + "]" * 200)])
NUMBER = st.integers(-2, 60) | WEIRD
SHAPE = st.lists(NUMBER, max_size=3) | st.sampled_from(
    [[0, 2**64], [2**62, 8, 0], [0, 2**62, 8], [0, 2**63 - 1, 2], [Raw("-0")], [1] * 70])
DTYPE = st.sampled_from([*DTYPE_BITS, "Q4", "f32", "bf16", "", 5, None, ["F32"], Obj()])
NAME = st.text(st.characters(exclude_categories=()), max_size=4) | st.just("__metadata__")


def _set(entry: Obj, key: str, value) -> None:
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
    entry, fields = header[i][1], dict(header[i][1])
    kind = draw(st.sampled_from(["reshape", "retype", "swap", "reorder", "offsets", "shape",
                                 "dtype", "field", "entry", "name", "duplicate", "drop",
                                 "metadata", "top"]))
    if kind == "reshape" and isinstance(shape := fields.get("shape"), list):
        _set(entry, "shape", draw(st.permutations(shape + [1] * draw(st.integers(0, 2)))))
    elif kind == "retype" and (bits := DTYPE_BITS.get(str(fields.get("dtype")))):
        _set(entry, "dtype", draw(st.sampled_from([d for d, b in DTYPE_BITS.items()
                                                   if b == bits])))
    elif kind == "swap":  # valid where the two are the same size
        other = header[j][1]
        offsets = dict(other).get("data_offsets")
        _set(other, "data_offsets", fields.get("data_offsets"))
        _set(entry, "data_offsets", offsets)
    elif kind == "reorder":
        header[:] = draw(st.permutations(header))
    elif kind == "offsets":
        _set(entry, "data_offsets", draw(st.lists(NUMBER, min_size=1, max_size=3) | NUMBER))
    elif kind == "shape":
        _set(entry, "shape", draw(SHAPE | NUMBER))
    elif kind == "dtype":
        _set(entry, "dtype", draw(DTYPE))
    elif kind == "field":  # a field given twice (JSON keeps the last), or an unknown one
        entry.insert(0, draw(st.sampled_from(entry) | st.tuples(st.just("x"), NUMBER)))
    elif kind == "entry":
        header[i] = (header[i][0], draw(NUMBER))
    elif kind == "name":
        header[i] = (draw(NAME), entry)
    elif kind == "duplicate":
        header.append((header[i][0], Obj(entry)))
    elif kind == "drop":
        del header[i]
    elif kind == "metadata":
        value = draw(st.builds(lambda v: Obj([("k", v)]), NUMBER | st.just("v")) | NUMBER)
        header.insert(draw(st.sampled_from([0, len(header)])), ("__metadata__", value))
    elif kind == "top":
        return draw(NUMBER | st.just(Raw("{" * 3000 + "}" * 3000)))
    return header


DAMAGE = ("structure", "bytes", "length", "data")


@st.composite
def mutants(draw, damage=DAMAGE) -> bytes:
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


READERS = {"as-is": {}, "member-by-member": {"WHOLE_MAX_CHARS": 0},  # tiny chunks split
           "tiny-window": {"WHOLE_MAX_CHARS": 0, "CHUNK_BYTES": 7, "MEMBER_MAX_CHARS": 200}}


def _mapped(path, reader: str) -> MappedFile:
    with ExitStack() as stack:
        for name, value in READERS[reader].items():
            stack.enter_context(mock.patch.object(json_stream, name, value))
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
    try:
        with safe_open(str(path), "pt") as f:
            return all(f.get_tensor(name) is not None for name in f.keys())  # noqa: SIM118
    except Exception:  # SafetensorError, or torch refusing the tensor it builds
        return False


@FUZZ
@given(content=mutants(), reader=st.sampled_from(list(READERS)))
def test_a_mutant_is_bad_input_or_exactly_what_safetensors_reads(tmp_path_factory, content,
                                                                 reader):
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
    """Only the length field and the data region's size changed: every byte is read where
    the file is accepted, and a file that lost data is refused."""
    path = _write(tmp_path_factory, content)
    try:
        mapped = _mapped(path, "as-is")
    except BadInput:
        return
    assert len(content) >= len(BASE), "accepted a file whose data is cut short"
    for name in mapped.names:
        _bytes(mapped.tensor(name))


def test_the_unmutated_file_is_accepted_by_every_reader(tmp_path_factory):
    """The mutants' base is read whole, member by member and in tiny windows alike (were
    it refused, the differential test above would pass vacuously)."""
    path = _write(tmp_path_factory, BASE)
    for reader in READERS:
        assert sorted(_mapped(path, reader).names) == BASE_NAMES


def _one(header: str, data: bytes = b"") -> bytes:
    raw = header.encode("utf-8", "surrogatepass")
    return struct.pack("<Q", len(raw)) + raw + data


def _u8(before: str = "", inside: str = "", after: str = "", name: str = '"a"') -> bytes:
    """A one-byte U8 tensor's file, its header text spliced."""
    return _one("{" + before + name + ":{" + inside + '"dtype":"U8","shape":[1],'
                '"data_offsets":[0,1]' + after + "}}", b"x")


@pytest.mark.parametrize("content", [
    _one('{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}}', b"x"),  # past the end
    _one('{"a":{"dtype":["U8"],"shape":[1],"data_offsets":[0,1]}}', b"x"),
    _one('{"a":{"dtype":"U8","shape":[0,18446744073709551616],"data_offsets":[0,0]}}'),
    _one('{"a":{"dtype":"U8","shape":[4611686018427387904,8,0],"data_offsets":[0,0]}}'),
    _one('{"a":{"dtype":"U8","shape":[-0],"data_offsets":[0,0]}}'),
    _u8(inside='"dtype":"F32",'),  # a field given twice
    _u8(before='"__metadata__":{"k":1},'),
    _u8(before='"__metadata__":{},"__metadata__":{},'),
    _u8(name='"\\ud800"'),  # a lone surrogate: no UTF-8 spells it
    _u8(after=',"x":NaN'),
    _u8(after=',"x":' + "[" * 200 + "]" * 200),
], ids=["past-end", "dtype-list", "dim-2**64", "shape-overflow", "minus-zero", "twice",
        "metadata-int", "metadata-twice", "surrogate", "nan", "nested-200"])
@pytest.mark.parametrize("reader", list(READERS))
def test_a_file_safetensors_refuses_is_bad_input(tmp_path_factory, content, reader):
    """Each of these safetensors refuses (checked here); ours must too, before a view."""
    path = _write(tmp_path_factory, content)
    assert not _safetensors_reads(path)
    with pytest.raises(BadInput):
        mapped = _mapped(path, reader)
        for name in mapped.names:
            _bytes(mapped.tensor(name))
