"""Delta weight versions: only the elements whose bits changed since the base.

Small Adam updates vanish in bf16 rounding, so from one policy version to the
next most stored elements keep their exact bits. A delta lists, per tensor,
the positions whose bits differ, as gaps from the one before, and for each
the XOR of its old and new bits; both as LEB128 varints (7 bits a byte), so
a gap under 128 and a change of the low mantissa bits take a byte each.
Comparing and XORing bits, not values, makes reconstruction exact for every
dtype (NaN payloads, -0.0). No general-purpose compressor on top: zlib at
its fastest took 4x the time of this coding for 3 % fewer bytes than it,
before the XOR (a 100M model's step, in scripts/bench_weight_sync.py's
setting).

A delta blob is `MAGIC`, an 8-byte little-endian header length, a JSON header
(versions, the digests of base and result, per tensor name, dtype, shape,
changed count and encoded size), the encoded parts, and a SHA-256 of
everything before it: a torn or corrupted blob is refused before any
element is written. `weights_digest` names a version's exact tensors; the
receiver checks the base it patches and the result it installs against it.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import struct
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

MAGIC = b"LGRDELT2"  # 1: zlib-compressed fixed-width gaps and new bits
_SUM = hashlib.sha256().digest_size
_THREADS = 8  # hashlib and numpy release the GIL on large buffers (SHA-256 ran faster than BLAKE2b here)
_VARINT_BYTES = 10  # the most a LEB128 uint64 takes


class DeltaError(ValueError):
    """A delta cannot be built or applied: the message says why."""


class BaseMismatch(DeltaError):
    """The weights a delta is applied to are not the version it was made against."""


@dataclasses.dataclass(frozen=True)
class DeltaHeader:
    base_version: int
    version: int
    base_digest: str
    digest: str
    tensors: list[dict[str, Any]]

    @property
    def changed(self) -> int:
        return sum(t["changed"] for t in self.tensors)

    @property
    def total(self) -> int:
        return sum(int(np.prod(t["shape"])) for t in self.tensors)


@functools.cache
def _pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=_THREADS, thread_name_prefix="weight-delta")


def _bits(array: np.ndarray) -> np.ndarray:
    """The array's elements as unsigned integers of the same width, flat, no copy."""
    flat = np.ascontiguousarray(array).reshape(-1)
    return flat.view(np.dtype(f"<u{flat.dtype.itemsize}"))


def tensor_sum(name: str, array: np.ndarray) -> bytes:
    """One tensor's part of `weights_digest`: its name, dtype, shape and bytes."""
    hasher = hashlib.sha256(json.dumps([name, str(array.dtype), list(array.shape)]).encode())
    hasher.update(np.ascontiguousarray(array).reshape(-1).view(np.uint8).data)
    return hasher.digest()


def combine_sums(sums: Mapping[str, bytes]) -> str:
    """`weights_digest` from every tensor's `tensor_sum`, so a receiver can hash tensors as they arrive."""
    return hashlib.sha256(b"".join(sums[name] for name in sorted(sums))).hexdigest()


def tensor_sums(tensors: Mapping[str, np.ndarray], names: Iterable[str] | None = None) -> dict[str, bytes]:
    """`tensor_sum` of the named tensors (all by default), hashed in parallel."""
    names = list(tensors if names is None else names)
    return dict(zip(names, _pool().map(lambda n: tensor_sum(n, tensors[n]), names), strict=True))


def weights_digest(tensors: Mapping[str, np.ndarray]) -> str:
    """A hex digest of every tensor's name, dtype, shape and bytes."""
    return combine_sums(tensor_sums(tensors))


def _varints(values: np.ndarray) -> np.ndarray:
    """`values` (unsigned) as LEB128: low 7 bits first, the high bit set on every byte but a value's last."""
    values = values.astype(np.uint64, copy=False)
    lengths = np.ones(values.size, np.int64)
    for width in range(7, 64, 7):
        lengths += values >= np.uint64(1 << width)
    starts = np.cumsum(lengths) - lengths
    out = np.empty(int(lengths.sum()), np.uint8)
    for k in range(int(lengths.max(initial=0))):
        sel = lengths > k
        byte = (values[sel] >> np.uint64(7 * k)).astype(np.uint8) & 0x7F
        out[starts[sel] + k] = byte | np.where(lengths[sel] > k + 1, 0x80, 0).astype(np.uint8)
    return out


def _read_varints(raw: np.ndarray, count: int, name: str) -> np.ndarray:
    """Exactly `count` LEB128 values from the bytes `raw`, as uint64."""
    ends = np.flatnonzero(raw < 0x80)  # a value's last byte
    if ends.size != count or (count and ends[-1] != raw.size - 1) or (not count and raw.size):
        raise DeltaError(f"{name}: {raw.size} bytes do not hold {count} varints")
    starts = np.concatenate(([0], ends[:-1] + 1)).astype(np.int64)
    lengths = ends - starts + 1
    if lengths.max(initial=1) > _VARINT_BYTES:
        raise DeltaError(f"{name}: a varint longer than {_VARINT_BYTES} bytes")
    values = np.zeros(count, np.uint64)
    for k in range(int(lengths.max(initial=0))):
        sel = lengths > k
        values[sel] |= (raw[starts[sel] + k] & 0x7F).astype(np.uint64) << np.uint64(7 * k)
    return values


def _encode_tensor(old: np.ndarray, new: np.ndarray) -> tuple[int, bytes]:
    old_bits, new_bits = _bits(old), _bits(new)
    where = np.flatnonzero(old_bits != new_bits)
    gaps = np.diff(where, prepend=-1)  # from the previous changed position, the first from -1
    flips = old_bits[where] ^ new_bits[where]
    return len(where), _varints(np.concatenate([gaps.astype(np.uint64), flips.astype(np.uint64)])).tobytes()


def encode_delta(
    old: Mapping[str, np.ndarray],
    new: Mapping[str, np.ndarray],
    *,
    base_version: int,
    version: int,
    base_digest: str,
    digest: str,
) -> bytes:
    """The delta blob that turns `old` into `new`; both must hold the same tensors."""
    if old.keys() != new.keys():
        raise DeltaError(f"tensor sets differ: {sorted(old.keys() ^ new.keys())[:5]}")
    names = sorted(new)
    for name in names:
        if (old[name].dtype, old[name].shape) != (new[name].dtype, new[name].shape):
            was, now = f"{old[name].dtype}{list(old[name].shape)}", f"{new[name].dtype}{list(new[name].shape)}"
            raise DeltaError(f"{name}: {was} became {now}")
    parts = list(_pool().map(lambda n: _encode_tensor(old[n], new[n]), names))
    header = {
        "base_version": base_version,
        "version": version,
        "base_digest": base_digest,
        "digest": digest,
        "tensors": [
            {"name": n, "dtype": str(new[n].dtype), "shape": list(new[n].shape), "changed": c, "nbytes": len(p)}
            for n, (c, p) in zip(names, parts, strict=True)
        ],
    }
    raw_header = json.dumps(header, separators=(",", ":")).encode()
    body = b"".join([MAGIC, struct.pack("<Q", len(raw_header)), raw_header, *(p for _, p in parts)])
    return body + hashlib.sha256(body).digest()


def read_header(blob: bytes | memoryview) -> DeltaHeader:
    """The blob's header, after checking its checksum and framing."""
    blob = memoryview(blob)
    if len(blob) < len(MAGIC) + 8 + _SUM or bytes(blob[: len(MAGIC)]) != MAGIC:
        raise DeltaError("not a weight delta (bad magic or too short)")
    if hashlib.sha256(blob[:-_SUM]).digest() != bytes(blob[-_SUM:]):
        raise DeltaError("weight delta checksum mismatch: torn or corrupted transfer")
    (size,) = struct.unpack("<Q", blob[len(MAGIC) : len(MAGIC) + 8])
    start = len(MAGIC) + 8
    try:
        header = DeltaHeader(**json.loads(bytes(blob[start : start + size])))
    except (ValueError, TypeError) as exc:
        raise DeltaError(f"weight delta header is malformed: {exc}") from None
    if start + size + sum(t["nbytes"] for t in header.tensors) + _SUM != len(blob):
        raise DeltaError("weight delta parts do not add up to its length")
    return header


def _decode_tensor(spec: dict[str, Any], part: bytes | memoryview, target: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(positions, new bits) of one tensor, bounds-checked against `target`."""
    bits, name, count = _bits(target), spec["name"], spec["changed"]
    if not isinstance(count, int) or not 0 <= count <= bits.size:
        raise DeltaError(f"{name}: {count!r} changes in a tensor of {bits.size} elements")
    values = _read_varints(np.frombuffer(part, np.uint8), 2 * count, name)
    gaps, flips = values[:count], values[count:]
    # Each gap at least 1 and at most the size: the positions rise and their sum cannot wrap.
    if count and (gaps.min() == 0 or gaps.max() > bits.size):
        raise DeltaError(f"{name}: changed positions out of order or out of range")
    where = np.cumsum(gaps, dtype=np.int64) - 1
    if count and where[-1] >= bits.size:
        raise DeltaError(f"{name}: changed positions out of order or out of range")
    if count and (flips.min() == 0 or flips.max() >= 2 ** (8 * bits.itemsize)):
        raise DeltaError(f"{name}: a change that flips no bits or more bits than a {target.dtype} element holds")
    return where, bits[where] ^ flips.astype(bits.dtype)


def apply_delta(base: dict[str, np.ndarray], blob: bytes | memoryview, base_digest: str) -> DeltaHeader:
    """`patch`, then the result's digest checked: a mismatch raises DeltaError,
    and the caller must discard `base`."""
    header = patch(base, blob, base_digest)
    if weights_digest(base) != header.digest:
        raise DeltaError(f"weights after the delta to version {header.version} do not match its digest")
    return header


def patch(base: dict[str, np.ndarray], blob: bytes | memoryview, base_digest: str) -> DeltaHeader:
    """Patches `base` (the delta's base version, digest `base_digest`) in place into
    the delta's version, unverified: the caller checks `weights_digest` against
    the returned header's before using it. Every part is decoded and checked
    before the first element is written, so a bad blob leaves `base` as it was."""
    header = read_header(blob)
    if base_digest != header.base_digest:
        raise BaseMismatch(f"delta to version {header.version} needs base version {header.base_version} "
                           f"({header.base_digest[:12]}), got weights {base_digest[:12]}")  # fmt: skip
    specs = {t["name"]: t for t in header.tensors}
    if specs.keys() != base.keys():
        raise DeltaError(f"delta and base hold different tensors: {sorted(specs.keys() ^ base.keys())[:5]}")
    for name, spec in specs.items():
        if not base[name].flags.c_contiguous:
            raise DeltaError(f"{name}: the base array must be C-contiguous to be patched in place")
        if (spec["dtype"], spec["shape"]) != (str(base[name].dtype), list(base[name].shape)):
            raise DeltaError(f"{name}: delta is for {spec['dtype']}{spec['shape']}, base holds "
                             f"{base[name].dtype}{list(base[name].shape)}")  # fmt: skip
    view = memoryview(blob)
    offset = len(MAGIC) + 8 + struct.unpack("<Q", view[len(MAGIC) : len(MAGIC) + 8])[0]
    parts = []
    for spec in header.tensors:
        parts.append((spec, view[offset : offset + spec["nbytes"]]))
        offset += spec["nbytes"]
    decoded = list(_pool().map(lambda sp: _decode_tensor(sp[0], sp[1], base[sp[0]["name"]]), parts))
    for (spec, _), (where, values) in zip(parts, decoded, strict=True):
        _bits(base[spec["name"]])[where] = values
    return header
