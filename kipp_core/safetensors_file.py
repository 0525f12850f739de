"""Read and write safetensors with numpy alone, memory-mapped, with errors that name the file.

Layout: 8-byte little-endian header length N, N bytes of JSON
`{name: {dtype, shape, data_offsets}}`,
then the data. bf16 has no numpy dtype: it is read as uint16 and widened with `bf16_to_f32`.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# safetensors dtype name -> numpy storage dtype (bf16 is stored as its raw uint16 bits)
NP_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": np.uint16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U64": np.uint64,
    "U32": np.uint32,
    "U16": np.uint16,
    "U8": np.uint8,
    "BOOL": np.bool_,
}
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")
_MAX_HEADER = 100 * 1024 * 1024


@dataclass(frozen=True)
class RawTensor:
    """A tensor as stored: `data` is a read-only memmap view in the storage dtype."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    data: np.ndarray

    def to_numpy(self, dtype=np.float32) -> np.ndarray:
        """Float tensors widened (or narrowed) to `dtype`; others returned as stored."""
        if self.dtype == "BF16":
            return bf16_to_f32(self.data).astype(dtype, copy=False)
        if self.dtype in FLOAT_DTYPES:
            return self.data.astype(dtype)
        return np.asarray(self.data)


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(x: np.ndarray) -> np.ndarray:
    """Round to nearest even, as torch's `.to(torch.bfloat16)` does; returns the uint16 bits."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounding = ((u >> 16) & 1) + np.uint32(0x7FFF)
    return ((u + rounding) >> 16).astype(np.uint16)


def round_to_bf16(x: np.ndarray) -> np.ndarray:
    return bf16_to_f32(f32_to_bf16(x))


class SafetensorsFile:
    """One `.safetensors` file, opened lazily through a single read-only memmap."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.is_file():
            raise ValueError(f"checkpoint file not found: {self.path}")
        size = self.path.stat().st_size
        with open(self.path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ValueError(
                    f"checkpoint file {self.path} is truncated: {size} bytes, no header"
                )
            (n,) = struct.unpack("<Q", head)
            if n > _MAX_HEADER or 8 + n > size:
                raise ValueError(
                    f"checkpoint file {self.path} is truncated or corrupt: header claims {n} "
                    "bytes, "
                    f"file has {size}"
                )
            raw = f.read(n)
        try:
            header = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"checkpoint file {self.path} has a corrupt header: {e}") from None
        if not isinstance(header, dict):
            raise ValueError(f"checkpoint file {self.path} has a corrupt header: not an object")
        self.metadata = header.pop("__metadata__", None) or {}
        self._base = 8 + n
        self._size = size
        self._entries: dict[str, tuple[str, tuple[int, ...], int, int]] = {}
        for name, e in header.items():
            try:
                dtype, shape, (start, end) = e["dtype"], tuple(e["shape"]), e["data_offsets"]
            except (KeyError, TypeError, ValueError):
                raise ValueError(
                    f"checkpoint file {self.path}: corrupt entry for tensor {name!r}"
                ) from None
            if dtype not in NP_DTYPES:
                raise ValueError(f"checkpoint file {self.path}: tensor {name!r} has dtype {dtype}")
            nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(NP_DTYPES[dtype]).itemsize
            if end - start != nbytes or start < 0:
                raise ValueError(
                    f"checkpoint file {self.path}: tensor {name!r} of shape {list(shape)} {dtype} "
                    f"needs {nbytes} bytes, its offsets give {end - start}"
                )
            if self._base + end > size:
                raise ValueError(
                    f"checkpoint file {self.path} is truncated: tensor {name!r} ends at byte "
                    f"{self._base + end}, the file has {size}"
                )
            self._entries[name] = (dtype, shape, start, end)
        self._mm: np.memmap | None = None

    def keys(self) -> list[str]:
        return list(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def get(self, name: str) -> RawTensor:
        dtype, shape, start, end = self._entries[name]
        if self._mm is None:
            self._mm = np.memmap(self.path, dtype=np.uint8, mode="r")
        buf = self._mm[self._base + start : self._base + end]
        data = buf.view(NP_DTYPES[dtype]).reshape(shape)
        return RawTensor(name, dtype, shape, data)


def save_file(
    tensors: dict[str, tuple[str, np.ndarray]],
    path: str | os.PathLike,
    metadata: dict[str, str] | None = None,
) -> None:
    """Write `{name: (dtype, array)}`; for BF16 the array holds the uint16 bits."""
    header: dict = {}
    if metadata:
        header["__metadata__"] = metadata
    offset = 0
    arrays = []
    for name, (dtype, arr) in tensors.items():
        arr = np.ascontiguousarray(arr, dtype=NP_DTYPES[dtype])
        header[name] = {
            "dtype": dtype,
            "shape": list(arr.shape),
            "data_offsets": [offset, offset + arr.nbytes],
        }
        offset += arr.nbytes
        arrays.append(arr)
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned
    tmp = Path(str(path) + ".tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for arr in arrays:
            f.write(arr.tobytes())
    os.replace(tmp, path)
