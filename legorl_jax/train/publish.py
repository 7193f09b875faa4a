"""Weight publishing: the learner's half of a narrow publisher/subscriber seam.

A `WeightPublisher` turns the policy into HF safetensors somewhere and returns
the location; `WeightSubscribers` make the rollout servers load a location.
The pairs in use:

- `DirectoryPublisher` + `Fleet` (shared storage): `Fleet.update_weights`
  sends the location in `UpdateWeights`, every server reads it.
- `DirectoryPublisher` on a local path + `WeightStreamer` (no shared storage):
  the streamer sends the published directory over `StreamWeights`.

`DirectoryPublisher` writes `root/v{version:08d}/` (via `to_hf`) and a `LATEST`
file naming the newest complete version. A plain path (or file://) is written
under a hidden name and renamed into place; any other scheme (`gs://`, ...) is a
tensorstore kvstore, uploaded file by file from a local staging copy,
`weights.json` last (hosts refuse a version without it), where
`LATEST` is written only after the whole version is up. Either way a publish
that dies half-way leaves `LATEST` on the previous version. Versions beyond the
newest `keep` are deleted; `keep` must cover the policy lag, since a server may
still be asked to load a version a step or two old.

Every version carries `weights.json` (`legorl_jax.core.weight_layout.Manifest`: the
version, the digest of its exact tensors, and the learner's logprobs of the fixed
probe sequence, `legorl_jax.core.weight_probe`, which each host checks its engine
against after loading the version). With `full_every` K > 1 every
version after the first is also a delta against the one before
(`legorl_jax.core.weight_delta`: the stored elements whose bits changed,
varint-coded), and only every K-th version (and the first, and any after a gap)
is also a full checkpoint. A host serving the version before applies the
delta; one that missed versions rebuilds from the last full checkpoint and
the deltas since, so hosts in step never fetch a full checkpoint again.
`keep` then also covers the versions back to the last full one. The
publisher holds the previous version's tensors in the stored dtype in host
memory to diff against (16 GB for an 8B model in bf16).

A LoRA run may publish the adapters alone (`adapter_base`: the base checkpoint
the run started from): each version is then PEFT's adapter directory and its
manifest, which names the base's digest (`checkpoint_digest`) and carries the
probe of base + adapter; hosts load it onto the base they serve. Adapter
versions are never deltas: an adapter is already a small fraction of the model.

Publish before the first rollout: step-0 trajectories must come from the
learner's real weights, not from whatever the engine booted with.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import logging
import math
import os
import re
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Executor
from pathlib import Path
from typing import Any, Literal, Protocol

import jax
import jax.numpy as jnp
import numpy as np
import tensorstore as ts
from flax import nnx
from jax.experimental import multihost_utils

from legorl_jax.core.files import replace_text
from legorl_jax.core.weight_delta import encode_delta, read_header, weights_digest
from legorl_jax.core.weight_layout import (
    DELTA_FILE,
    MANIFEST_FILE,
    Manifest,
    checkpoint_digest,
    install_directory,
    read_tensors,
    version_dir_name,
)
from legorl_jax.core.weight_probe import WeightProbe, probe_token_ids
from legorl_jax.models import CausalLM, to_hf
from legorl_jax.models.config import DType
from legorl_jax.models.hf_io import _hf_tensors
from legorl_jax.models.logprobs import token_logprobs
from legorl_jax.models.lora import peft_tensors, save_peft

log = logging.getLogger(__name__)

LATEST_FILE = "LATEST"
DEFAULT_SHARD_BYTES = 2 * 2**30
_VERSION_RE = re.compile(r"^v(\d{8})$")
_STAGING_PREFIX = ".publishing-"


class PublishError(RuntimeError):
    """Weights could not be published (bad root, storage failure)."""


class WeightPublisher(Protocol):
    def publish(self, model: CausalLM, version: int) -> str:
        """Writes `model` as policy `version`; returns the location servers load."""
        ...


class WeightSubscribers(Protocol):
    # Per server, how far its engine's probe logprobs were from the learner's at the last update.
    probe_diffs: dict[str, float]

    async def update_weights(self, version: int, location: str) -> dict[str, int]:
        """Makes every server load `location`; returns address -> loaded version."""
        ...


@dataclasses.dataclass(frozen=True)
class PublishReport:
    version: int
    location: str
    publish_s: float
    load_s: float
    loaded: dict[str, int]
    probe_diffs: dict[str, float]

    def probe_max_abs_diff(self) -> float | None:
        """The largest probe difference any server reported (None: none carried a probe)."""
        diffs = [d for d in self.probe_diffs.values() if math.isfinite(d)]
        return max(diffs) if diffs else None


async def publish_weights(
    publisher: WeightPublisher,
    subscribers: WeightSubscribers,
    model: CausalLM,
    version: int,
    *,
    executor: Executor | None = None,
) -> PublishReport:
    """Publishes `model` as `version` and has the servers load it, timing both.
    The export runs on `executor` (default: the event loop's).

    Multi-host: every process must publish (to_hf gathers across hosts), so
    call this on every process with subscribers that do nothing off process 0.
    """
    started = time.monotonic()
    # The export is host-bound (device gets, disk writes); keep the event loop live.
    in_context = contextvars.copy_context().run
    location = await asyncio.get_running_loop().run_in_executor(executor, in_context, publisher.publish, model, version)
    published = time.monotonic()
    loaded = await subscribers.update_weights(version, location)
    load_s = time.monotonic() - published
    return PublishReport(version, location, published - started, load_s, loaded, dict(subscribers.probe_diffs))


@dataclasses.dataclass(frozen=True)
class PublishStats:
    """What one publish wrote: a full checkpoint, a delta or both; the fraction
    of stored elements that changed since the previous version (1.0 without a
    delta); and the bytes a host serving the previous version fetches."""

    version: int
    kind: Literal["full", "delta", "delta+full", "adapter"]
    changed_fraction: float
    nbytes: int


def _keep_versions(versions: set[int], published: int, keep: int, chain_from: int) -> set[int]:
    """The published version, the `keep - 1` newest older ones, and every one
    from `chain_from` (the last full checkpoint, which later deltas build on).
    Newer ones are from a timeline a resumed run abandoned."""
    older = sorted((v for v in versions if v < published), reverse=True)
    return {published, *older[: keep - 1], *(v for v in versions if chain_from <= v < published)}


def _parse_version(name: str) -> int | None:
    match = _VERSION_RE.match(name)
    return int(match.group(1)) if match else None


class _LocalStore:
    def __init__(self, root: Path) -> None:
        self.root = root.absolute()

    def location(self, version: int) -> str:
        return str(self.root / version_dir_name(version))

    def publish(self, version: int, write: Callable[[Path], None], keep: int, chain_from: int) -> str:
        name = version_dir_name(version)
        tmp = self.root / f"{_STAGING_PREFIX}{name}-{uuid.uuid4().hex[:8]}"
        try:
            write(tmp)
            if jax.process_index() == 0:
                install_directory(tmp, self.root / name)
                replace_text(self.root / LATEST_FILE, name + "\n")
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        if jax.process_index() == 0:
            self._collect(version, keep, chain_from)
        return self.location(version)

    def _collect(self, published: int, keep: int, chain_from: int) -> None:
        entries = {p.name: p for p in self.root.iterdir() if p.is_dir()}
        versions = {v for n in entries if (v := _parse_version(n)) is not None}
        kept = _keep_versions(versions, published, keep, chain_from)
        for name, path in entries.items():
            version = _parse_version(name)
            # One publisher per root: any staging directory left now is a dead publish's.
            if name.startswith(_STAGING_PREFIX) or (version is not None and version not in kept):
                shutil.rmtree(path, ignore_errors=True)

    def latest(self) -> str | None:
        pointer = self.root / LATEST_FILE
        return str(self.root / pointer.read_text().strip()) if pointer.is_file() else None


class _KvStore:
    """A tensorstore kvstore root: gs://bucket/prefix, memory://, ..."""

    def __init__(self, url: str, context: ts.Context | None) -> None:
        self.url = url.rstrip("/")
        try:
            self._kv = ts.KvStore.open(self.url + "/", context=context).result()
        except ValueError as exc:
            raise PublishError(f"cannot open {url} with tensorstore: {exc}") from None

    def location(self, version: int) -> str:
        return f"{self.url}/{version_dir_name(version)}"

    def _done(self, future: Any, what: str) -> Any:
        """A tensorstore future's result; a storage failure (unreachable, refused) as PublishError."""
        try:
            return future.result()
        except (ValueError, RuntimeError, OSError) as exc:
            raise PublishError(f"{self.url}: cannot {what}: {exc}") from None

    def _delete_version(self, name: str) -> None:
        # Every key under "name/": "/" + 1 == "0" bounds the range.
        self._done(self._kv.delete_range(ts.KvStore.KeyRange(f"{name}/", f"{name}0")), f"delete {name}/")

    def upload(self, key: str, path: Path) -> None:
        self._done(self._kv.write(key, path.read_bytes()), f"write {key}")

    def publish(self, version: int, write: Callable[[Path], None], keep: int, chain_from: int) -> str:
        name = version_dir_name(version)
        with tempfile.TemporaryDirectory(prefix="legorl-publish-") as staging:
            out = Path(staging) / name
            write(out)
            if jax.process_index() == 0:
                self._delete_version(name)  # leftovers of an earlier, torn upload of this version
                # One file in memory at a time; to_hf's shard size bounds it. The manifest goes last: hosts
                # refuse a remote version without one, so a torn upload is never served.
                for file in sorted(out.iterdir(), key=lambda f: (f.name == MANIFEST_FILE, f.name)):
                    self.upload(f"{name}/{file.name}", file)
                self._done(self._kv.write(LATEST_FILE, (name + "\n").encode()), f"write {LATEST_FILE}")
        if jax.process_index() == 0:
            self._collect(version, keep, chain_from)
        return self.location(version)

    def _collect(self, published: int, keep: int, chain_from: int) -> None:
        tops = {key.decode().split("/", 1)[0] for key in self._done(self._kv.list(), "list")}
        versions = {v for n in tops if (v := _parse_version(n)) is not None}
        for version in versions - _keep_versions(versions, published, keep, chain_from):
            self._delete_version(version_dir_name(version))

    def latest(self) -> str | None:
        result = self._done(self._kv.read(LATEST_FILE), f"read {LATEST_FILE}")
        return f"{self.url}/{result.value.decode().strip()}" if result.state == "value" else None


@nnx.jit
def _probe_logprobs(model: CausalLM, tokens: np.ndarray) -> jax.Array:
    return token_logprobs(model, jnp.asarray(tokens))


def weight_probe(model: CausalLM, stored: DType | None = None) -> WeightProbe:
    """The model's logprobs of the probe sequence (every process computes them: the
    model may be sharded across all of them)."""
    ids = probe_token_ids(model.config.vocab_size)
    out = _probe_logprobs(model, np.asarray([ids], np.int32))
    host = np.asarray(out if out.is_fully_addressable else multihost_utils.process_allgather(out, tiled=True))
    dtypes = (stored or model.config.param_dtype, model.config.compute_dtype)
    return WeightProbe(tuple(ids), tuple(float(x) for x in host[0]), dtypes)


@dataclasses.dataclass
class _Published:
    """The previous version as hosts will rebuild it: the base of the next delta."""

    version: int
    digest: str
    tensors: dict[str, np.ndarray]


class DirectoryPublisher:
    """Publishes HF safetensors to `root/v{version:08d}/`, keeping the newest `keep`.

    root: a local path, file:// URI, or a tensorstore kvstore URL (gs://...).
    dtype: the stored dtype (default: the parameters'); bfloat16 halves the
    bytes servers load. full_every: when above 1, every version after the
    first is also a delta on the one before, and a full checkpoint is written
    every this many versions (1: always full, no deltas). context: a
    `tensorstore.Context` for kvstore roots. `last` describes the latest
    publish. Multi-host: every process calls `publish`; process 0 writes.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        keep: int = 3,
        tokenizer_from: str | os.PathLike[str] | None = None,
        dtype: DType | None = None,
        max_shard_bytes: int = DEFAULT_SHARD_BYTES,
        full_every: int = 1,
        adapter_base: str | os.PathLike[str] | None = None,
        context: ts.Context | None = None,
    ) -> None:
        if adapter_base is not None and full_every != 1:
            raise ValueError(f"full_every={full_every}: adapter versions are never deltas; give 1")
        if keep < 1:
            raise ValueError(f"keep must be at least 1, got {keep}")
        if full_every < 1:
            raise ValueError(f"full_every must be at least 1, got {full_every}")
        if tokenizer_from is not None and not Path(tokenizer_from).is_dir():
            raise ValueError(f"tokenizer_from={tokenizer_from} is not a directory")
        root = os.fspath(root)
        self.keep = keep
        self.full_every = full_every
        self.last: PublishStats | None = None
        self._dtype = dtype
        self._export: dict[str, Any] = dict(tokenizer_from=tokenizer_from, dtype=dtype, max_shard_bytes=max_shard_bytes)
        self._previous: _Published | None = None
        self._full_version = 0
        self._adapter_base = None if adapter_base is None else Path(adapter_base)
        self._base_digest: str | None = None  # of `adapter_base`, read once on the first publish
        self._store: _LocalStore | _KvStore
        if root.startswith("file://") or "://" not in root:
            local = Path(root.removeprefix("file://"))
            try:
                local.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise PublishError(f"cannot create publish root {local}: {exc}") from None
            self._store = _LocalStore(local)
        else:
            self._store = _KvStore(root, context)

    def publish(self, model: CausalLM, version: int) -> str:
        if version < 0:
            raise ValueError(f"version must be non-negative, got {version}")
        # After a gap (a resumed run) hosts may hold anything: no delta, a full checkpoint.
        base = self._previous if self._previous is not None and self._previous.version == version - 1 else None
        full = base is None or version - self._full_version >= self.full_every
        written: list[tuple[_Published, PublishStats]] = []  # process 0's, kept only once installed

        probe = weight_probe(model, self._dtype)

        def write(out: Path) -> None:
            if self._adapter_base is not None:
                written.extend(self._write_adapter(model, version, out, probe))
            else:
                written.extend(self._write(model, version, out, base, full, probe))

        location = self._store.publish(version, write, self.keep, version if full else self._full_version)
        if full:
            self._full_version = version
        for published, stats in written:
            self._previous = published if self.full_every > 1 else None
            self.last = stats
            log.info("published version %d: %s, %.4f of elements changed, %d bytes", version, stats.kind,
                     stats.changed_fraction, stats.nbytes)  # fmt: skip
        return location

    def _write(
        self, model: CausalLM, version: int, out: Path, base: _Published | None, full: bool, probe: WeightProbe
    ) -> list[tuple[_Published, PublishStats]]:
        if full:
            to_hf(model, out, **self._export)
        else:
            # The same export to_hf writes, so a delta rebuilds exactly what a full publish would store.
            exported = dict(_hf_tensors(model, jnp.dtype(self._dtype or model.config.param_dtype)))
        if jax.process_index() != 0:
            return []
        # A full checkpoint is hashed as hosts will read it: the digest then checks every copy against these files.
        tensors = read_tensors(out) if full else exported
        digest = weights_digest(tensors)
        out.mkdir(parents=True, exist_ok=True)
        if base is None:
            (out / MANIFEST_FILE).write_bytes(Manifest(version, digest, probe=probe).to_bytes())
            nbytes = sum(p.stat().st_size for p in out.iterdir())
            return [(_Published(version, digest, tensors), PublishStats(version, "full", 1.0, nbytes))]
        blob = encode_delta(base.tensors, tensors, base_version=base.version, version=version,
                            base_digest=base.digest, digest=digest)  # fmt: skip
        (out / DELTA_FILE).write_bytes(blob)
        (out / MANIFEST_FILE).write_bytes(Manifest(version, digest, base.version, base.digest, probe).to_bytes())
        header = read_header(blob)
        kind: Literal["delta", "delta+full"] = "delta+full" if full else "delta"
        stats = PublishStats(version, kind, header.changed / max(header.total, 1), len(blob))
        return [(_Published(version, digest, tensors), stats)]

    def _write_adapter(
        self, model: CausalLM, version: int, out: Path, probe: WeightProbe
    ) -> list[tuple[_Published, PublishStats]]:
        """The adapters as PEFT writes them, and a manifest naming the base they apply to."""
        if jax.process_index() != 0:
            peft_tensors(model)  # the gathers save_peft makes on process 0
            return []
        assert self._adapter_base is not None
        if self._base_digest is None:
            self._base_digest = checkpoint_digest(self._adapter_base)
        save_peft(model, out, base_model=str(self._adapter_base))
        digest = weights_digest(read_tensors(out))  # as hosts will read it
        manifest = Manifest(version, digest, probe=probe, adapter_base=self._base_digest)
        (out / MANIFEST_FILE).write_bytes(manifest.to_bytes())
        nbytes = sum(p.stat().st_size for p in out.iterdir())
        return [(_Published(version, digest, {}), PublishStats(version, "adapter", 1.0, nbytes))]

    def latest(self) -> str | None:
        """Location of the newest completely published version, if any."""
        return self._store.latest()
