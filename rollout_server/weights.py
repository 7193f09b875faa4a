"""The rollout host's side of weight publishing: turning what the learner sends
into a local HF directory the engine can reload from.

Two ways in, matching the two RPCs:

- `resolve_location(uri, cache_root)` for `UpdateWeights`: a local path or
  `file://` URI is used in place, when it lies inside the server's weight
  roots (`roots`); `gs://`, `s3://` and `memory://` are
  tensorstore kvstore prefixes, downloaded once into `cache_root` (a full one
  only with its `weights.json`, which the publisher uploads last); any other
  scheme is refused (the server fetches nothing from arbitrary URLs).
- `receive_stream(chunks, dest_root)` for `StreamWeights`: a header with the
  small files (config, tokenizer, the safetensors index) followed by tensor
  chunks, assembled one safetensors file at a time. The tensors a stream
  announces must fit the index's total size and the free disk space, and a
  sender that goes quiet for `idle_timeout_s` is dropped.

An adapter version (a LoRA run's, `Manifest.adapter_base`) is PEFT's adapter
directory: by location it is used in place or downloaded like a full one; by
stream its header carries `adapter_config.json` and the manifest, and the
chunks that follow (the `delta` payload) are `adapter_model.safetensors`. The
host checks the base it serves before the engine loads it (`RolloutService`).

A published version carries `weights.json` (`Manifest`: its version and the
digest of its exact tensors, `weight_delta.weights_digest`). A delta version
(`weight_delta`) holds only the manifest, naming its base, and `delta.bin`;
the host patches the weights it serves when they are that base, else first
rebuilds the base the same way from the version before it, down to the
nearest full one (a host that missed versions catches up from the last full
checkpoint plus deltas). Received or rebuilt weights whose digest differs
from the manifest's are never installed.

Given a `ServedTensors` (`memory`), the host keeps the served version's
tensors in memory: a streamed full version's stay after they are written, a
delta patches them in place instead of reading the served directory back,
and only the tensors it changed are rehashed (the others keep their checked
sums). The order stays: patch, write the new directory while hashing, check
the digest, rename it into place, and only then may the engine reload it
and the host report it; the engine reloads from that directory, so the write
stays on the path to serving. To make it cheap, a version is written
over the files of a version directory that installing it prunes anyway
(never the delta's base, never the one served), whose pages the page cache
still holds.

Both build the directory under a hidden temporary name and rename it into place
only when it is complete, so the engine never sees a half-written version and a
failed transfer leaves nothing behind. Older versions are pruned to `keep`, but
the directory the engine serves from is kept until it has moved off it (a host
catching up installs several versions first).
Blocking calls (`resolve_location`) belong in a worker thread under asyncio.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import math
import os
import shutil
import uuid
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Collection, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np
import tensorstore as ts

from legorl_jax.core import safetensors_io
from legorl_jax.core.weight_delta import (
    BaseMismatch,
    DeltaError,
    combine_sums,
    patch,
    tensor_sum,
    tensor_sums,
    weights_digest,
)
from legorl_jax.core.weight_layout import (
    ADAPTER_CONFIG_FILE,
    ADAPTER_WEIGHTS_FILE,
    DELTA_FILE,
    INDEX_FILE,
    MANIFEST_FILE,
    TMP_PREFIX,
    Manifest,
    WeightTransferError,
    install_directory,
    parse_index,
    read_manifest,
    read_tensors,
    version_dir_name,
    weight_files,
)
from legorl_jax.core.weight_probe import WeightProbe
from protos.legorl.v1 import rollout_pb2 as pb
from rollout_server.served_tensors import Held, ServedTensors

DEFAULT_KEEP = 2
# Bound on a streamed adapter: rank 64 on every projection of an 8B model in float32 is ~0.7 GB.
MAX_ADAPTER_BYTES = 4 * 2**30
# Kvstore schemes a location may name; tensorstore would also open http(s)://, which lists nothing and
# would make the server fetch from any URL a caller names.
REMOTE_SCHEMES = ("gs", "s3", "memory")

# Temporary directories this process is filling; any other one under a root is
# debris of a process that died mid-transfer (one server owns a root).
_ACTIVE: set[Path] = set()


class WeightStreamStalled(WeightTransferError):
    """The sender went quiet mid-stream for longer than the idle timeout."""


class WeightBaseMismatch(WeightTransferError):
    """A delta arrived for a base version this host does not serve."""


@functools.cache
def _hasher() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="weights-digest")


def install_delta(
    base: Path,
    blob: bytes,
    dest_root: Path,
    keep: int = DEFAULT_KEEP,
    memory: ServedTensors | None = None,
    served: Path | None = None,
    probe: WeightProbe | None = None,
    protect: Collection[Path] = (),
) -> tuple[int, Path]:
    """Patches the weights of `base` with a delta blob into a new directory under
    `dest_root`, installed only once its digest matches; returns (version, directory).
    `probe`, from the delta's manifest, goes into the new version's.
    With `memory` holding `base`'s tensors they are patched instead of read from
    disk, and the new version's are held there once it is installed. The
    directory the engine `served` from stays whole (it may be another than
    `base` while a host catches up) until the engine has moved off it, and so
    do the `protect`ed ones (`prune_versions`)."""
    manifest = read_manifest(base)
    if manifest is None:
        raise WeightBaseMismatch(f"{base} has no {MANIFEST_FILE}; a delta applies only to published weights")
    held = None if memory is None else memory.take(base, manifest.digest)
    tensors = read_tensors(base) if held is None else held.tensors
    try:
        header = patch(tensors, blob, manifest.digest)
    except (BaseMismatch, DeltaError) as exc:
        if held is not None and memory is not None:  # a refused delta wrote nothing: still the base's tensors
            memory.hold(held)
        kind = WeightBaseMismatch if isinstance(exc, BaseMismatch) else WeightTransferError
        raise kind(str(exc)) from None
    # Tensors the delta left alone keep their sums; only the rest are rehashed,
    # while the files are written. A mismatch discards them before anything is installed.
    changed = None if held is None else [t["name"] for t in header.tensors if t["changed"]]
    sums = _hasher().submit(tensor_sums, tensors, changed)
    label = version_dir_name(header.version)
    with _staged(dest_root, label, reuse=_doomed(dest_root, label, keep, {base, served, *protect})) as tmp:
        by_file: dict[str, list[str]] = {}
        for name, file in weight_files(base).items():
            by_file.setdefault(file, []).append(name)
        sides = [p for p in base.iterdir() if p.is_file() and not p.name.endswith(".safetensors")]
        sides = [p for p in sides if p.name != MANIFEST_FILE]
        _clear_except(tmp, [*by_file, *(p.name for p in sides), MANIFEST_FILE])
        for file, names in by_file.items():
            safetensors_io.save_file({n: tensors[n] for n in names}, tmp / file)
        for side in sides:
            shutil.copyfile(side, tmp / side.name)
        (tmp / MANIFEST_FILE).write_bytes(Manifest(header.version, header.digest, probe=probe).to_bytes())
        new_sums = {**({} if held is None else held.sums), **sums.result()}
        if combine_sums(new_sums) != header.digest:
            raise WeightTransferError(f"weights after the delta to version {header.version} do not match its digest")
        final = dest_root / version_dir_name(header.version)
        install_directory(tmp, final)
    if memory is not None:
        memory.hold(Held(final, header.digest, tensors, new_sums))
    prune_versions(dest_root, keep, final, served, protect)
    return header.version, final


def prune_versions(
    root: Path, keep: int, current: Path, served: Path | None = None, protect: Collection[Path] = ()
) -> None:
    """Keeps `current` and the newest `keep - 1` other directories, and always
    the one the engine still `served` from and the `protect`ed ones (after a
    failed reload, every directory the engine may still be reading); removes
    the rest and the debris of dead transfers."""
    debris = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(TMP_PREFIX) and p not in _ACTIVE]
    for path in debris + _prunable(root, keep, current, {served, *protect}):
        shutil.rmtree(path, ignore_errors=True)


def _prunable(root: Path, keep: int, current: Path, protected: set[Path | None]) -> list[Path]:
    """The version directories beyond `current` and the newest `keep - 1` others,
    oldest last, less the `protected` ones."""
    versions = [p for p in root.iterdir() if p.is_dir() and not p.name.startswith(TMP_PREFIX) and p != current]
    # Ties (directories made within one tick of the clock) go by name: v{version:08d} sorts by version.
    versions.sort(key=lambda p: (p.stat().st_mtime_ns, p.name), reverse=True)
    return [p for p in versions[max(keep - 1, 0) :] if p not in protected]


def _doomed(root: Path, label: str, keep: int, protected: set[Path | None]) -> Path | None:
    """A version directory that installing version `label` will prune anyway,
    never a `protected` one (the delta's base, the one served): the new version
    is written over its files, whose pages the page cache still holds
    (`safetensors_io.save_file`)."""
    doomed = _prunable(root, keep, root / label, protected) if root.is_dir() else []
    return doomed[-1] if doomed else None


def _clear_except(directory: Path, names: Iterable[str]) -> None:
    """Removes what a reused directory holds beyond the files about to be written."""
    for stale in set(directory.iterdir()) - {directory / name for name in names}:
        shutil.rmtree(stale) if stale.is_dir() else stale.unlink()


@contextmanager
def _staged(root: Path, label: str, reuse: Path | None = None) -> Iterator[Path]:
    """A staging directory under `root` for one version, fresh or `reuse`d (moved
    here, its files to be overwritten): pruning leaves it alone while it is
    filled, and a failure removes it (nothing partial stays)."""
    tmp = root / f"{TMP_PREFIX}{label}-{uuid.uuid4().hex[:8]}"
    if reuse is None:
        tmp.mkdir(parents=True)
    else:
        reuse.rename(tmp)
        os.utime(tmp)  # pruning orders versions by this time: it is now the newest
    _ACTIVE.add(tmp)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        _ACTIVE.discard(tmp)


def _plain_name(name: str, what: str) -> str:
    """A bare file name: a sender must not place files outside the directory."""
    if not name or name in (".", "..") or "/" in name or "\\" in name or "\0" in name:
        raise WeightTransferError(f"{what} {name!r} is not a plain file name")
    return name


# ------------------------------------------------------------- streaming ---


class _Tensor:
    def __init__(self, name: str, file: str, dtype: str, shape: tuple[int, ...]) -> None:
        self.file, self.dtype, self.shape = file, dtype, shape
        try:
            self.array = np.empty(shape, safetensors_io.SAFETENSORS_DTYPES[dtype])
        except (MemoryError, OverflowError, ValueError) as exc:
            raise WeightTransferError(f"tensor {name!r}: cannot hold {dtype}{list(shape)}: {exc}") from None
        self.received = 0

    @property
    def complete(self) -> bool:
        return self.received == self.array.nbytes


class _Assembly:
    """Validates a weight stream and writes each safetensors file as soon as all
    of its tensors are in, so memory holds about one file, not the model
    (unless `keep_arrays`: then the whole model stays, to be held as served)."""

    def __init__(self, header: pb.WeightHeader, tmp: Path, keep_arrays: bool = False) -> None:
        self.version = header.version
        # Kept after writing (the whole model in memory) only for a receiver that holds the served tensors.
        self.keep_arrays = keep_arrays
        self.arrays: dict[str, np.ndarray] = {}
        self.tmp = tmp
        self.files = {_plain_name(n, "header file"): bytes(v) for n, v in header.files.items()}
        if any(name.endswith(".safetensors") for name in self.files):
            raise WeightTransferError("header carries a .safetensors file; tensors travel only as chunks")
        if "config.json" not in self.files:
            raise WeightTransferError("header lacks config.json")
        if INDEX_FILE not in self.files:
            raise WeightTransferError(f"header lacks {INDEX_FILE} (the sender always sends the index)")
        self.weight_map, self.total_size = parse_index(self.files[INDEX_FILE])
        # What the announced tensors may add up to: the index's own total, and never more than the disk holds.
        free = shutil.disk_usage(tmp).free
        if self.total_size is not None and self.total_size > free:
            raise WeightTransferError(f"index says {self.total_size} bytes in total; only {free} bytes free on disk")
        self.budget = free if self.total_size is None else self.total_size
        self.budget_is = (
            f"the {free} bytes free on disk"
            if self.total_size is None
            else (f"the index's {self.total_size} bytes in total")
        )
        self.announced = 0
        if not self.weight_map:
            raise WeightTransferError(f"{INDEX_FILE} in the header lists no tensors")
        self.pending: dict[str, set[str]] = {}
        for name, file in self.weight_map.items():
            if not _plain_name(file, "index file").endswith(".safetensors"):
                raise WeightTransferError(f"index maps {name} to {file!r}, not a .safetensors file")
            self.pending.setdefault(file, set()).add(name)
        _clear_except(tmp, [*self.pending, *self.files])
        self.tensors: dict[str, _Tensor] = {}
        self.done: set[str] = set()
        self.received_bytes = 0
        self.manifest = Manifest.parse(self.files[MANIFEST_FILE], "header") if MANIFEST_FILE in self.files else None
        # Each tensor is hashed in the background as soon as it is complete, while the next ones arrive.
        self.sums: dict[str, Future[bytes]] = {}

    def add(self, chunk: pb.TensorChunk) -> str | None:
        """Stores one chunk; returns a file name once all of its tensors are in."""
        name = chunk.name
        if name not in self.weight_map:
            raise WeightTransferError(f"tensor {name!r} is not in the header's index")
        if name in self.done:
            raise WeightTransferError(f"tensor {name!r} was already received in full")
        shape = tuple(int(d) for d in chunk.shape)
        tensor = self.tensors.get(name)
        if tensor is None:
            if chunk.dtype not in safetensors_io.SAFETENSORS_DTYPES:
                raise WeightTransferError(f"tensor {name!r}: unknown safetensors dtype {chunk.dtype!r}")
            # Sized in Python integers before anything is allocated: a shape can claim any number of bytes.
            nbytes = math.prod(shape) * safetensors_io.SAFETENSORS_DTYPES[chunk.dtype].itemsize
            if self.announced + nbytes > self.budget:
                raise WeightTransferError(
                    f"tensor {name!r}: {chunk.dtype}{list(shape)} needs {nbytes} bytes; with the tensors before it "
                    f"that exceeds {self.budget_is}"
                )
            tensor = self.tensors[name] = _Tensor(name, self.weight_map[name], chunk.dtype, shape)
            self.announced += nbytes
        elif (chunk.dtype, shape) != (tensor.dtype, tensor.shape):
            said, earlier = f"{chunk.dtype}{list(shape)}", f"{tensor.dtype}{list(tensor.shape)}"
            raise WeightTransferError(f"tensor {name!r}: chunk says {said}, earlier chunks {earlier}")
        # Chunks of a tensor arrive in order on one stream; anything else is a broken sender.
        if chunk.offset != tensor.received:
            raise WeightTransferError(f"tensor {name!r}: chunk at byte {chunk.offset}, expected {tensor.received}")
        end = tensor.received + len(chunk.data)
        if end > tensor.array.nbytes:
            raise WeightTransferError(
                f"tensor {name!r}: {end} bytes sent, but {tensor.dtype}{list(tensor.shape)} holds {tensor.array.nbytes}"
            )
        tensor.array.reshape(-1).view(np.uint8)[tensor.received : end] = np.frombuffer(chunk.data, np.uint8)
        tensor.received = end
        if not tensor.complete:
            return None
        self.done.add(name)
        self.received_bytes += tensor.array.nbytes
        if self.manifest is not None:
            self.sums[name] = _hasher().submit(tensor_sum, name, tensor.array)
        waiting = self.pending[tensor.file]
        waiting.discard(name)
        return None if waiting else tensor.file

    def write_file(self, file: str) -> None:
        names = [n for n, f in self.weight_map.items() if f == file]
        safetensors_io.save_file({n: self.tensors[n].array for n in names}, self.tmp / file)
        for n in names:
            if self.keep_arrays:
                self.arrays[n] = self.tensors[n].array
            del self.tensors[n]

    def tensor_sums(self) -> dict[str, bytes]:
        """Every received tensor's `tensor_sum`, once hashed."""
        return {name: future.result() for name, future in self.sums.items()}

    def finish(self) -> None:
        missing = sorted(set(self.weight_map) - self.done)
        if missing:
            raise WeightTransferError(f"stream ended with {len(missing)} tensors incomplete or missing: {missing[:5]}")
        if self.total_size is not None and self.total_size != self.received_bytes:
            raise WeightTransferError(f"index says {self.total_size} bytes in total, received {self.received_bytes}")
        if self.manifest is not None and combine_sums(self.tensor_sums()) != self.manifest.digest:
            raise WeightTransferError(f"received tensors do not match the digest of version {self.manifest.version}")
        for name, data in self.files.items():
            (self.tmp / name).write_bytes(data)


async def receive_stream(
    chunks: AsyncIterable[pb.WeightChunk],
    dest_root: Path,
    *,
    keep: int = DEFAULT_KEEP,
    idle_timeout_s: float | None = None,
    base: Path | None = None,
    memory: ServedTensors | None = None,
    protect: Collection[Path] = (),
) -> tuple[int, Path]:
    """Assembles a `StreamWeights` stream into `dest_root/v{version:08d}`;
    returns (version, directory). A delta stream patches `base`, the weights
    served now. Raises WeightTransferError on a malformed stream (its subclass
    WeightBaseMismatch when `base` is not the delta's base),
    WeightStreamStalled when no message comes for `idle_timeout_s`; either way
    nothing is left under dest_root. With `memory`, the installed version's
    tensors are held there (`ServedTensors`), and a delta patches the held ones.
    Pruning spares `base` and the `protect`ed directories (`prune_versions`)."""
    dest_root = Path(dest_root)
    dest_root.mkdir(parents=True, exist_ok=True)
    stream: AsyncIterator[pb.WeightChunk] = aiter(chunks)

    async def next_message() -> pb.WeightChunk | None:
        try:
            return await asyncio.wait_for(anext(stream, None), idle_timeout_s)
        except TimeoutError:
            raise WeightStreamStalled(f"the sender sent nothing for {idle_timeout_s:g} s; transfer abandoned") from None

    first = await next_message()
    if first is None or first.WhichOneof("payload") != "header":
        raise WeightTransferError("a weight stream must start with a header message")
    raw_manifest = first.header.files.get(MANIFEST_FILE)
    if raw_manifest is not None and Manifest.parse(raw_manifest, "header").adapter_base is not None:
        return await _receive_adapter(first.header, next_message, dest_root, keep, base, protect)
    if first.header.delta:
        blob, manifest = await _receive_delta(first.header, next_message, base)
        return await asyncio.to_thread(
            install_delta,
            base,  # type: ignore[arg-type]
            blob,
            dest_root,
            keep,
            memory,
            base,
            manifest.probe,
            protect,
        )
    if memory is not None:
        memory.clear()  # a full version replaces it: no two models in memory while this one arrives
    label = version_dir_name(first.header.version)
    with _staged(dest_root, label, reuse=_doomed(dest_root, label, keep, {base, *protect})) as tmp:
        assembly = _Assembly(first.header, tmp, keep_arrays=memory is not None)
        while (message := await next_message()) is not None:
            if message.WhichOneof("payload") != "tensor":
                raise WeightTransferError("only the first message of a weight stream may be a header")
            finished = assembly.add(message.tensor)
            if finished is not None:
                await asyncio.to_thread(assembly.write_file, finished)
        assembly.finish()
        final = dest_root / version_dir_name(assembly.version)
        install_directory(tmp, final)
    if memory is not None and assembly.manifest is not None:  # checked against its digest in finish()
        memory.hold(Held(final, assembly.manifest.digest, assembly.arrays, assembly.tensor_sums()))
    prune_versions(dest_root, keep, final, base, protect)
    return assembly.version, final


async def _receive_adapter(
    header: pb.WeightHeader,
    next_message: Callable[[], Awaitable[pb.WeightChunk | None]],
    dest_root: Path,
    keep: int,
    base: Path | None,
    protect: Collection[Path],
) -> tuple[int, Path]:
    """An adapter stream installed as `dest_root/v{version:08d}` once its tensors match the manifest's digest."""
    if set(header.files) != {MANIFEST_FILE, ADAPTER_CONFIG_FILE}:
        raise WeightTransferError(
            f"an adapter header carries {MANIFEST_FILE} and {ADAPTER_CONFIG_FILE} alone, got {sorted(header.files)}"
        )
    manifest = Manifest.parse(header.files[MANIFEST_FILE], "header")
    label = version_dir_name(manifest.version)
    with _staged(dest_root, label) as tmp:
        with (tmp / ADAPTER_WEIGHTS_FILE).open("wb") as out:
            while (message := await next_message()) is not None:
                if message.WhichOneof("payload") != "delta":
                    raise WeightTransferError("an adapter stream carries only delta chunks after its header")
                out.write(message.delta)
                if out.tell() > MAX_ADAPTER_BYTES:
                    raise WeightTransferError(f"adapter exceeds {MAX_ADAPTER_BYTES} bytes")
        for name, data in header.files.items():
            (tmp / name).write_bytes(data)
        try:
            digest = await asyncio.to_thread(lambda: weights_digest(read_tensors(tmp)))
        except (OSError, ValueError) as exc:
            raise WeightTransferError(
                f"adapter of version {manifest.version} is not a safetensors file: {exc}"
            ) from None
        if digest != manifest.digest:
            raise WeightTransferError(f"received adapter does not match the digest of version {manifest.version}")
        final = dest_root / label
        install_directory(tmp, final)
    prune_versions(dest_root, keep, final, base, protect)
    return manifest.version, final


async def _receive_delta(
    header: pb.WeightHeader, next_message: Callable[[], Awaitable[pb.WeightChunk | None]], base: Path | None
) -> tuple[bytes, Manifest]:
    """A delta stream's blob, bounded by what a delta of `base` can weigh, and its manifest."""
    if set(header.files) != {MANIFEST_FILE}:
        raise WeightTransferError(f"a delta header carries {MANIFEST_FILE} alone, got {sorted(header.files)}")
    manifest = Manifest.parse(header.files[MANIFEST_FILE], "header")
    served = read_manifest(base)
    if (
        base is None
        or served is None
        or (served.version, served.digest) != (manifest.base_version, manifest.base_digest)
    ):
        have = "no published weights" if served is None else f"version {served.version}"
        raise WeightBaseMismatch(f"delta to version {manifest.version} needs base version {manifest.base_version}; "
                                 f"this host serves {have}")  # fmt: skip
    # A gap and an XOR per changed element, as varints: at most ~3 bytes per stored byte (every element of a
    # 1-byte dtype changed: 1-byte gaps, XORs of up to 2 bytes), so 5x and the header's MB bound any delta.
    limit = 5 * sum(p.stat().st_size for p in base.glob("*.safetensors")) + 2**20
    blob = bytearray()
    while (message := await next_message()) is not None:
        if message.WhichOneof("payload") != "delta":
            raise WeightTransferError("a delta stream carries only delta chunks after its header")
        blob += message.delta
        if len(blob) > limit:
            raise WeightTransferError(f"delta exceeds {limit} bytes, more than any delta of the served weights")
    return bytes(blob), manifest


# -------------------------------------------------------------- location ---


def resolve_location(
    uri: str,
    cache_root: Path,
    *,
    keep: int = DEFAULT_KEEP,
    context: ts.Context | None = None,
    current: Path | None = None,
    memory: ServedTensors | None = None,
    protect: Collection[Path] = (),
    roots: Collection[Path] | None = None,
) -> Path:
    """The local HF directory for an `UpdateWeights` location. Blocking.

    A local location must lie inside one of `roots` (resolved directories),
    `..` and symlinks resolved first (`confined_weights_dir`); None takes any
    (a caller in this process, not a request).

    A delta version is applied to `current` (the directory served now) when
    that is its base; otherwise the base is rebuilt first from its sibling
    `v{base:08d}` under the same parent, down to the nearest full version.
    `context` is a `tensorstore.Context` for remote schemes (tests share one
    with the writer to reach a `memory://` store). `memory` and `protect` are as for `receive_stream`."""
    if not uri:
        raise WeightTransferError("weights location is empty")
    local = uri.startswith("file://") or "://" not in uri
    scheme = uri.split("://", 1)[0]
    if not local and scheme not in REMOTE_SCHEMES:
        allowed = ", ".join(f"{s}://" for s in REMOTE_SCHEMES)
        raise WeightTransferError(f"{uri}: scheme {scheme}:// is not supported; use a local path, file://, {allowed}")
    if local and roots is not None:
        uri = str(confined_weights_dir(uri, roots))
    try:
        raw = _read(uri, MANIFEST_FILE, context)
    except WeightTransferError:
        raise
    except (OSError, ValueError) as exc:  # a NUL byte, a path the server may not read
        raise WeightTransferError(f"{uri}: not a usable path: {exc}") from None
    manifest = None if raw is None else Manifest.parse(raw, uri)
    if manifest is not None and manifest.adapter_base is not None:  # whole, small: in place or downloaded
        if local:
            return Path(uri.removeprefix("file://"))
        return _download(uri, Path(cache_root), keep, context, current, protect)
    base_version = None if manifest is None else manifest.base_version
    if (
        manifest is not None
        and base_version is not None
        and current is not None
        and _serves(current, base_version, manifest.base_digest)
    ):
        return _apply(uri, manifest, current, cache_root, keep, context, memory, current, protect)
    if _read(uri, "config.json", context) is not None:  # a full checkpoint (perhaps beside a delta)
        if memory is not None:
            memory.clear()  # read from its files by the first delta on it; the old version's go now
        if local:
            return Path(uri.removeprefix("file://"))
        return _download(uri, Path(cache_root), keep, context, current, protect)
    if manifest is None or base_version is None:
        raise WeightTransferError(f"{uri}: no config.json there; not an HF weights directory")
    if base_version >= manifest.version:
        raise WeightTransferError(f"{uri}: delta to version {manifest.version} on base {manifest.base_version}")
    # The base is rebuilt the same way, from its own base, down to the last full checkpoint.
    sibling = f"{uri.rstrip('/').rsplit('/', 1)[0]}/{version_dir_name(base_version)}"
    base = resolve_location(
        sibling, cache_root, keep=keep, context=context, current=current, memory=memory, protect=protect, roots=roots
    )
    return _apply(uri, manifest, base, cache_root, keep, context, memory, current, protect)


def confined_weights_dir(location: str, roots: Collection[Path]) -> Path:
    """A local `location` (path or `file://`) with `..` and symlinks resolved; refused
    unless it lies inside one of `roots`, so a request cannot have the engine read
    an arbitrary host directory (as task locations are confined: `tasks.confined_task_dir`)."""
    try:
        resolved = Path(location.removeprefix("file://")).resolve()
    except (OSError, ValueError) as exc:  # a NUL byte, a symlink loop
        raise WeightTransferError(f"{location}: not a usable path: {exc}") from None
    if not any(resolved.is_relative_to(root) for root in roots):
        raise WeightTransferError(
            f"{location}: outside the directories this server loads weights from; allow its directory in "
            "fleet.weights_location_roots (the run directory, logging.run_dir, and a local fleet.weights_dir are "
            "allowed already)"
        )
    return resolved


def _serves(current: Path, version: int, digest: str | None) -> bool:
    served = read_manifest(current)
    return served is not None and (served.version, served.digest) == (version, digest)


def _apply(
    uri: str,
    manifest: Manifest,
    base: Path,
    cache_root: Path,
    keep: int,
    context: ts.Context | None,
    memory: ServedTensors | None,
    served: Path | None,
    protect: Collection[Path],
) -> Path:
    """The delta version at `uri` built on `base`, installed under `cache_root`."""
    blob = _read(uri, DELTA_FILE, context)
    if blob is None:
        raise WeightTransferError(f"{uri}: its {MANIFEST_FILE} names a delta, but there is no {DELTA_FILE}")
    return install_delta(base, blob, Path(cache_root), keep, memory, served, manifest.probe, protect)[1]


def _read(uri: str, name: str, context: ts.Context | None) -> bytes | None:
    """One file of a version directory, local or remote; None when absent."""
    if uri.startswith("file://") or "://" not in uri:
        path = Path(uri.removeprefix("file://")) / name
        return path.read_bytes() if path.is_file() else None
    kv = _ts(uri, "open", ts.KvStore.open(uri.rstrip("/") + "/", context=context))
    result = _ts(uri, f"read {name}", kv.read(name))
    return bytes(result.value) if result.state == "value" else None


def _ts(uri: str, what: str, future: Any) -> Any:
    """A tensorstore future's result; its failures (ValueError, NotImplementedError, ...) as WeightTransferError."""
    try:
        return future.result()
    except (ValueError, RuntimeError, OSError) as exc:
        raise WeightTransferError(f"{uri}: cannot {what} with tensorstore: {exc}") from None


def _download(
    uri: str, cache_root: Path, keep: int, context: ts.Context | None, served: Path | None, protect: Collection[Path]
) -> Path:
    prefix = uri.rstrip("/")
    # Always fetched, never served from the cache: a resumed run republishes
    # a version number with new weights at the same URI.
    name = f"{PurePosixPath(prefix).name}-{hashlib.sha256(prefix.encode()).hexdigest()[:12]}"
    final = cache_root / name
    try:
        opened = ts.KvStore.open(prefix + "/", context=context)
    except ValueError as exc:
        raise WeightTransferError(f"{uri}: cannot open with tensorstore: {exc}") from None
    kv = _ts(uri, "open", opened)
    keys = [key.decode(errors="replace") for key in _ts(uri, "list", kv.list())]
    if "config.json" not in keys and ADAPTER_CONFIG_FILE not in keys:
        raise WeightTransferError(f"{uri}: no config.json there; not an HF weights directory")
    if MANIFEST_FILE not in keys:
        # The publisher uploads it last, so without it the version's upload did not finish.
        raise WeightTransferError(f"{uri}: no {MANIFEST_FILE} there; its upload did not finish (a torn publish)")
    cache_root.mkdir(parents=True, exist_ok=True)
    with _staged(cache_root, name) as tmp:
        for key in keys:
            parts = [_plain_name(part, "remote file") for part in key.split("/")]
            target = tmp.joinpath(*parts)
            result = _ts(uri, f"read {key}", kv.read(key))
            if result.state != "value":
                raise WeightTransferError(f"{uri}: {key} vanished during the download")
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(result.value)
        install_directory(tmp, final)
    prune_versions(cache_root, keep, final, served, protect)
    return final
