"""The loader's view of a safetensors file (model/mapped_file.py): the same tensors
safetensors' own reader gives, for every dtype torch holds, read only when used."""

import os
import struct

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kvledger.engine.errors import BadInput
from kvledger.engine.model.mapped_file import SAFETENSORS_DTYPES, MappedFile


def _every_dtype() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    values = torch.randn(3, 5) * 4
    out = {}
    for name, dtype in SAFETENSORS_DTYPES.items():
        if dtype in (torch.uint16, torch.uint32, torch.uint64):
            out[name] = values.abs().to(torch.int64).to(dtype)
        elif dtype == torch.complex64:
            out[name] = torch.complex(values, -values)
        elif dtype == torch.float8_e8m0fnu:
            out[name] = values.abs().add(0.5).to(dtype)
        else:
            out[name] = values.to(dtype)
    out["empty"] = torch.empty(0, 7, dtype=torch.bfloat16)
    out["scalar"] = torch.tensor(2.5, dtype=torch.float32)
    return out


def test_every_tensor_is_what_safetensors_reads(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file(_every_dtype(), str(path))
    mapped = MappedFile(path)
    with safe_open(str(path), framework="pt") as f:
        assert sorted(mapped.names) == sorted(f.keys())
        for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
            want, got = f.get_tensor(name), mapped.tensor(name)
            assert got.dtype == want.dtype and got.shape == want.shape, name
            assert _bytes(got) == _bytes(want), name


def _bytes(tensor: torch.Tensor) -> bytes:
    """A tensor's bytes (equal floats compare so even where ``==`` is not defined)."""
    return tensor.reshape(-1).view(torch.uint8).numpy().tobytes()


def test_views_outlive_the_file_object_and_never_write_the_file(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file({"w": torch.arange(12, dtype=torch.float32).reshape(3, 4)}, str(path))
    before = path.read_bytes()
    tensor = MappedFile(path).tensor("w")  # the MappedFile itself is gone at once
    assert tensor[2, 3].item() == 11.0
    tensor.add_(100)  # copy on write: this process's pages only
    assert tensor[0, 0].item() == 100.0
    assert path.read_bytes() == before
    assert torch.equal(MappedFile(path).tensor("w"), torch.arange(12.0).reshape(3, 4))


def _write_raw(path, header: str, data: bytes) -> None:
    raw = header.encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def test_a_misaligned_tensor_is_copied_out_with_its_values(tmp_path):
    """safetensors pads its own headers so data starts aligned; another writer need not.
    A float32 tensor at an odd offset is copied, not viewed misaligned."""
    path = tmp_path / "odd.safetensors"
    values = torch.tensor([1.5, -2.0, 3.25], dtype=torch.float32)
    header = ('{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}, '
              '"b":{"dtype":"F32","shape":[3],"data_offsets":[1,13]}}')
    _write_raw(path, header, b"\x07" + values.numpy().tobytes())
    mapped = MappedFile(path)
    assert (8 + len(header) + 1) % 4  # truly misaligned
    assert torch.equal(mapped.tensor("b"), values)
    assert mapped.tensor("a").tolist() == [7]


def test_a_corrupt_or_unholdable_file_is_bad_input(tmp_path):
    truncated = tmp_path / "truncated.safetensors"
    _write_raw(truncated, '{"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}', b"\0" * 8)
    with pytest.raises(BadInput, match="truncated"):
        MappedFile(truncated)
    four_bit = tmp_path / "f4.safetensors"
    _write_raw(four_bit, '{"w":{"dtype":"F4","shape":[4],"data_offsets":[0,2]}}', b"\0\0")
    with pytest.raises(BadInput, match="F4"):
        MappedFile(four_bit).tensor("w")


@pytest.mark.parametrize("left", [0, 8 + 60, None], ids=["emptied", "cut", "unchanged"])
def test_the_file_checked_is_the_file_mapped(tmp_path, monkeypatch, left):
    """The header is read through the descriptor that is mapped: a file cut short between
    the two (replaced or truncated under the loader) is refused, never mapped short."""
    from kvledger.engine.model import mapped_file

    path = tmp_path / "w.safetensors"
    save_file({"w": torch.arange(64, dtype=torch.float32)}, path)
    checked = mapped_file.read_open_layout

    def then_cut(path_, handle):
        layout = checked(path_, handle)
        if left is not None:
            os.truncate(path_, left)
        return layout

    monkeypatch.setattr(mapped_file, "read_open_layout", then_cut)
    if left is None:
        assert MappedFile(path).tensor("w").tolist() == list(range(64))
        return
    with pytest.raises(BadInput, match="shrank while it was read"):
        MappedFile(path)


def test_a_field_safetensors_does_not_define_is_named(tmp_path):
    """No writer adds a field to a tensor's entry; one that is there is refused by name
    (safetensors skips it, unless its value is JSON its parser refuses)."""
    path = tmp_path / "extra.safetensors"
    _write_raw(path, '{"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1],"note":1}}', b"x")
    with pytest.raises(BadInput, match="'note'"):
        MappedFile(path)
