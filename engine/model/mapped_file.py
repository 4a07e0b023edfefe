"""A safetensors file's tensors as views of one private memory map of it: nothing is read
until a tensor's bytes are used.

safetensors' own ``safe_open(...).get_tensor`` touches each tensor's pages as it hands
the tensor over: cold, every tensor is a synchronous read where its bytes lie, and the
kernel's read-around makes each 8-16 MiB (291 tensors of a 1.45 GB checkpoint: 0.8-0.9 s
of reads in no useful order before a byte is used). Views of one map leave the reading
to the pass that uses the bytes (fusing, packing, copying to a GPU), which walks the file
in order, so the kernel reads it ahead as it goes (docs/benchmarks.md, "Time to ready":
a cold load of that checkpoint 0.2 s shorter).

The header is read and checked by ``checkpoint/safetensors_header.py`` (as strictly as
safetensors does: offsets contiguous from 0 and covering the data region), through the
descriptor that is then mapped, so every view lies inside the file mapped (a file cut
short after it is mapped is beyond any reader's check: a view of the lost bytes faults).
The map is private (copy on write): a tensor written to never reaches the file. A view
whose offset its dtype cannot be aligned to is copied out.
"""

from __future__ import annotations

import mmap
from pathlib import Path

import torch

from kvledger.engine.checkpoint.safetensors_header import TensorInfo, read_open_layout
from kvledger.engine.errors import BadInput

# safetensors' dtype names (checkpoint/safetensors_header.DTYPE_BITS) as torch's; the
# 4- and 6-bit floats have none.
SAFETENSORS_DTYPES = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16,
    "U16": torch.uint16, "I32": torch.int32, "U32": torch.uint32, "I64": torch.int64,
    "U64": torch.uint64, "F16": torch.float16, "BF16": torch.bfloat16,
    "F32": torch.float32, "F64": torch.float64, "C64": torch.complex64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "F8_E4M3FNUZ": torch.float8_e4m3fnuz, "F8_E5M2FNUZ": torch.float8_e5m2fnuz,
    "F8_E8M0": torch.float8_e8m0fnu,
}


class MappedFile:
    """One safetensors file, mapped: ``names`` in the header's order, ``tensor(name)`` a
    view (BadInput for a dtype torch has no tensors of: the 4- and 6-bit floats)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._map: mmap.mmap | None = None
        try:  # the file checked is the file mapped: one descriptor for both
            with open(self.path, "rb") as handle:
                infos, self._data_start = read_open_layout(self.path, handle)
                data_end = self._data_start + sum(info.nbytes for info in infos)
                if data_end > self._data_start:
                    self._map = _map(handle, self.path)
        except OSError as exc:
            raise BadInput(f"cannot read {self.path}: {exc.strerror or exc}") from None
        if self._map is not None and len(self._map) < data_end:
            raise BadInput(f"{self.path}: the file shrank while it was read "
                           f"({len(self._map)} bytes mapped, {data_end} checked)")
        self._infos: dict[str, TensorInfo] = {info.name: info for info in infos}

    @property
    def names(self) -> list[str]:
        return list(self._infos)

    def tensor(self, name: str) -> torch.Tensor:
        info = self._infos[name]
        dtype = SAFETENSORS_DTYPES.get(info.dtype)
        if dtype is None:
            raise BadInput(f"{self.path}: tensor {name!r} is {info.dtype}, which torch "
                           "holds no tensors of")
        if info.nbytes == 0 or self._map is None:
            return torch.empty(info.shape, dtype=dtype)
        offset = self._data_start + info.begin
        if offset % dtype.itemsize:  # a view would be misaligned for its dtype
            raw = torch.frombuffer(self._map, dtype=torch.uint8, count=info.nbytes,
                                   offset=offset)
            return raw.clone().view(dtype).view(info.shape)
        return torch.frombuffer(self._map, dtype=dtype, offset=offset,
                                count=info.nbytes // dtype.itemsize).view(info.shape)


def _map(handle, path: Path) -> mmap.mmap:
    """The whole file, private (copy on write)."""
    try:
        return mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)
    except ValueError:  # an empty file: emptied since its header was read
        raise BadInput(f"{path}: the file shrank while it was read") from None
