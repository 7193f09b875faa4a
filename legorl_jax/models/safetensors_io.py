"""Fast `.safetensors` reading and writing with plain file I/O.

The format is an 8-byte little-endian header length, a JSON header (dtype,
shape, byte range of each tensor) and the raw bytes. The safetensors library
cannot read bfloat16 into numpy (numpy has no such dtype name), makes one
device array per slice through its jax reader, and its writer ran at a third
of raw disk speed here (scripts/bench_hf_io.py). Reading straight into the
destination buffer with `readinto` and writing with `ndarray.tofile` runs at
raw file speed; the files stay readable by the library, transformers and vLLM.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

_DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
_NAMES = {dtype: name for name, dtype in _DTYPES.items()}
_MAX_HEADER = 100 * 2**20  # the format's own limit on the JSON header
_ALIGN = 8  # header padded so tensor data starts 8-byte aligned, as the library does


class SafetensorsFileError(ValueError):
    """The file is not a readable safetensors file."""


class SafetensorsFile:
    """Read access to one file: shapes from the header, tensor blocks on demand."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        with open(self.path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise SafetensorsFileError(f"{self.path}: truncated header")
            (size,) = struct.unpack("<Q", raw)
            if size > _MAX_HEADER:
                raise SafetensorsFileError(f"{self.path}: header of {size} bytes is not plausible")
            try:
                header = json.loads(f.read(size))
            except ValueError as exc:
                raise SafetensorsFileError(f"{self.path}: header is not JSON ({exc})") from None
        header.pop("__metadata__", None)
        self._entries: dict[str, dict[str, Any]] = header
        self._data_start = 8 + size
        self._file_size = self.path.stat().st_size

    def keys(self) -> list[str]:
        return list(self._entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._entries[name]["shape"])

    def _entry(self, name: str) -> tuple[np.dtype, tuple[int, ...], int]:
        entry = self._entries[name]
        if entry["dtype"] not in _DTYPES:
            raise SafetensorsFileError(f"{self.path}: {name} has unsupported dtype {entry['dtype']}")
        dtype, shape = _DTYPES[entry["dtype"]], tuple(entry["shape"])
        start, end = entry["data_offsets"]
        if end - start != dtype.itemsize * int(np.prod(shape)) or self._data_start + end > self._file_size:
            raise SafetensorsFileError(f"{self.path}: {name} has inconsistent data offsets")
        return dtype, shape, self._data_start + start

    def read_into(self, name: str, index: tuple[slice, ...], out: np.ndarray) -> None:
        """out[...] = tensor[index], converting dtype; out must be C-contiguous.

        A block that is a range of leading-axis rows is one contiguous byte
        range and is read directly into `out`; other blocks go through a
        memory map, touching only the pages they cover.
        """
        dtype, shape, offset = self._entry(name)
        index = tuple(index) + (slice(None),) * (len(shape) - len(index))
        bounds = [s.indices(n) for s, n in zip(index, shape, strict=True)]
        if any(step != 1 for _, _, step in bounds):
            raise ValueError(f"{name}: only unit-step slices are supported")
        row_range_only = all((lo, hi) == (0, n) for (lo, hi, _), n in zip(bounds[1:], shape[1:], strict=True))
        if not shape or row_range_only:
            row_bytes = dtype.itemsize * int(np.prod(shape[1:]))
            first, count = (bounds[0][0], bounds[0][1] - bounds[0][0]) if shape else (0, 1)
            buf = out if out.dtype == dtype else np.empty(out.shape, dtype)
            fd = os.open(self.path, os.O_RDONLY)
            try:
                got = os.preadv(fd, [memoryview(buf.reshape(-1).view(np.uint8))], offset + first * row_bytes)
            finally:
                os.close(fd)
            if got != count * row_bytes:
                raise SafetensorsFileError(f"{self.path}: {name} is truncated")
            if buf is not out:
                out[...] = buf
            return
        mapped = np.memmap(self.path, dtype, "r", offset=offset, shape=shape)
        out[...] = mapped[index]


def save_file(tensors: Mapping[str, np.ndarray], path: str | os.PathLike[str]) -> None:
    """Write C-contiguous arrays as a safetensors file (metadata format=pt, as HF expects)."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, array in tensors.items():
        if array.dtype not in _NAMES:
            raise ValueError(f"{name}: dtype {array.dtype} cannot be stored in safetensors")
        header[name] = {
            "dtype": _NAMES[array.dtype],
            "shape": list(array.shape),
            "data_offsets": [offset, offset + array.nbytes],
        }
        offset += array.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % _ALIGN)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for array in tensors.values():
            np.ascontiguousarray(array).reshape(-1).view(np.uint8).tofile(f)
