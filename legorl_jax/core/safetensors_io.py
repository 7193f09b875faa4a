"""Fast `.safetensors` reading and writing with plain file I/O.

The format is an 8-byte little-endian header length, a JSON header (dtype,
shape, byte range of each tensor) and the raw bytes. The safetensors library
cannot read bfloat16 into numpy (numpy has no such dtype name), makes one
device array per slice through its jax reader, and its writer ran at a third
of raw disk speed here (scripts/bench_hf_io.py). Reading straight into the
destination buffers with `preadv`, several reads in flight, and writing each
array's bytes with one `write` runs at raw file speed; the files stay readable by the
library, transformers and vLLM.
"""

from __future__ import annotations

import functools
import json
import os
import struct
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

# The format's dtype names -> numpy dtypes; ml_dtypes supplies the ones numpy lacks.
SAFETENSORS_DTYPES: dict[str, np.dtype] = {
    name: np.dtype(dtype)
    for name, dtype in {
        "F64": np.float64,
        "F32": np.float32,
        "F16": np.float16,
        "BF16": ml_dtypes.bfloat16,
        "F8_E4M3": ml_dtypes.float8_e4m3fn,
        "F8_E5M2": ml_dtypes.float8_e5m2,
        "I64": np.int64,
        "I32": np.int32,
        "I16": np.int16,
        "I8": np.int8,
        "U64": np.uint64,
        "U32": np.uint32,
        "U16": np.uint16,
        "U8": np.uint8,
        "BOOL": np.bool_,
    }.items()
}
_NAMES = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}
_MAX_HEADER = 100 * 2**20  # the format's own limit on the JSON header
# The header is padded with spaces (as the library pads to 8 bytes) so that tensor data
# starts on a page boundary: copies between page cache and buffers then run whole pages
# (writes measured faster than with the library's 8-byte alignment; scripts/bench_hf_io.py).
_DATA_ALIGN = 4096
_CHUNK = 16 * 2**20  # contiguous reads are split so that one large tensor also keeps several reads in flight
_READERS = min(8, os.cpu_count() or 1)  # reads in flight; more than the cores measured slower here


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

    def dtype(self, name: str) -> np.dtype:
        return self._entry(name)[0]

    def _entry(self, name: str) -> tuple[np.dtype, tuple[int, ...], int]:
        entry = self._entries[name]
        if entry["dtype"] not in SAFETENSORS_DTYPES:
            raise SafetensorsFileError(f"{self.path}: {name} has unsupported dtype {entry['dtype']}")
        dtype, shape = SAFETENSORS_DTYPES[entry["dtype"]], tuple(entry["shape"])
        start, end = entry["data_offsets"]
        if end - start != dtype.itemsize * int(np.prod(shape)) or self._data_start + end > self._file_size:
            raise SafetensorsFileError(f"{self.path}: {name} has inconsistent data offsets")
        return dtype, shape, self._data_start + start

    def read_into(self, name: str, index: tuple[slice, ...], out: np.ndarray) -> None:
        """out[...] = tensor[index], converting dtype; out must be C-contiguous."""
        read_blocks([(self, name, index, out)])

    def _plan(self, name: str, index: tuple[slice, ...], out: np.ndarray, stack: ExitStack) -> _Plan:
        """The reads that fill `out`, and what to do once they are all done.

        A block that is a range of leading-axis rows is one contiguous byte
        range, read straight into `out` in chunks that can be in flight
        together; other blocks go through a memory map, touching only the
        pages they cover.
        """
        dtype, shape, offset = self._entry(name)
        index = tuple(index) + (slice(None),) * (len(shape) - len(index))
        bounds = [s.indices(n) for s, n in zip(index, shape, strict=True)]
        if any(step != 1 for _, _, step in bounds):
            raise ValueError(f"{name}: only unit-step slices are supported")
        row_range_only = all((lo, hi) == (0, n) for (lo, hi, _), n in zip(bounds[1:], shape[1:], strict=True))
        if shape and not row_range_only:
            mapped = np.memmap(self.path, dtype, "r", offset=offset, shape=shape)

            def copy() -> None:
                out[...] = mapped[index]

            return [copy], None
        row_bytes = dtype.itemsize * int(np.prod(shape[1:]))
        first = bounds[0][0] if shape else 0
        buf = out if out.dtype == dtype else np.empty(out.shape, dtype)
        view = buf.reshape(-1).view(np.uint8).data
        if len(view) != buf.nbytes:
            raise ValueError(f"{name}: the destination must be C-contiguous")
        fd = os.open(self.path, os.O_RDONLY)
        stack.callback(os.close, fd)
        reads = _chunk_reads(fd, view, offset + first * row_bytes, f"{self.path}: {name} is truncated")
        if buf is out:
            return reads, None

        def convert() -> None:
            out[...] = buf

        return reads, convert


_Plan = tuple[list[Callable[[], None]], Callable[[], None] | None]
BlockRead = tuple[SafetensorsFile, str, tuple[slice, ...], np.ndarray]


def read_blocks(requests: Iterable[BlockRead]) -> None:
    """Fill each `out` with `file`'s tensor `name`[index], reads in parallel.

    One thread reading a checkpoint tensor by tensor leaves the disk (and,
    from the page cache, the other cores) idle between requests; with several
    reads in flight an import runs faster than one plain sequential read of
    the same bytes (scripts/bench_hf_io.py).
    """
    with ExitStack() as stack:
        plans = [f._plan(name, index, out, stack) for f, name, index, out in requests]
        _run_all([read for plan_reads, _ in plans for read in plan_reads])
        for _, finish in plans:
            if finish is not None:
                finish()


def _chunk_reads(fd: int, view: memoryview, start: int, short: str) -> list[Callable[[], None]]:
    """Tasks that each fill one chunk of `view` from `fd` at file offset `start` + its position."""

    def task(lo: int) -> Callable[[], None]:
        def run() -> None:
            part = view[lo : lo + _CHUNK]
            if os.preadv(fd, [part], start + lo) != len(part):
                raise SafetensorsFileError(short)

        return run

    return [task(lo) for lo in range(0, max(len(view), 1), _CHUNK)]


def _run_all(tasks: list[Callable[[], None]]) -> None:
    """Run reads several at a time (preadv releases the GIL); the first error is raised."""
    if len(tasks) == 1:
        tasks[0]()
        return
    for future in [_pool().submit(task) for task in tasks]:
        future.result()


@functools.cache
def _pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=_READERS, thread_name_prefix="safetensors-read")


def save_file(tensors: Mapping[str, np.ndarray], path: str | os.PathLike[str]) -> None:
    """Write C-contiguous arrays as a safetensors file (metadata format=pt, as HF expects).

    An existing file is overwritten in place and cut to the new length, not
    truncated first: its pages stay in the page cache and are reused, where a
    fresh file makes the kernel find and zero new ones (a 200 MB write took
    0.02 s over an existing file and 0.03-0.5 s as a new one here). Readers
    of the path see the same thing either way: the one inode changing."""
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
    blob += b" " * (-(8 + len(blob)) % _DATA_ALIGN)
    with open(os.open(path, os.O_WRONLY | os.O_CREAT, 0o666), "wb") as f:
        try:
            f.write(struct.pack("<Q", len(blob)))
            f.write(blob)
            # One sequential pass: parallel writes into the page cache measured slower here.
            # `write`, not numpy's `tofile`: a full disk then raises ENOSPC, not a bare short-write count.
            for array in tensors.values():
                f.write(np.ascontiguousarray(array).reshape(-1).view(np.uint8).data)
            f.truncate()
        except OSError as exc:
            exc.filename = exc.filename or str(path)
            raise
