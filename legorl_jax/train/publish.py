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
tensorstore kvstore, uploaded file by file from a local staging copy, where
`LATEST` is written only after the whole version is up. Either way a publish
that dies half-way leaves `LATEST` on the previous version. Versions beyond the
newest `keep` are deleted; `keep` must cover the policy lag, since a server may
still be asked to load a version a step or two old.

Publish before the first rollout: step-0 trajectories must come from the
learner's real weights, not from whatever the engine booted with.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import re
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import jax
import tensorstore as ts

from legorl_jax.models import CausalLM, to_hf
from legorl_jax.models.config import DType
from rollout_server.weights import install_directory, version_dir_name

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


async def publish_weights(
    publisher: WeightPublisher, subscribers: WeightSubscribers, model: CausalLM, version: int
) -> PublishReport:
    """Publishes `model` as `version` and has the servers load it, timing both.

    Multi-host: every process must publish (to_hf gathers across hosts), so
    call this on every process with subscribers that do nothing off process 0.
    """
    started = time.monotonic()
    # The export is host-bound (device gets, disk writes); keep the event loop live.
    location = await asyncio.to_thread(publisher.publish, model, version)
    published = time.monotonic()
    loaded = await subscribers.update_weights(version, location)
    return PublishReport(version, location, published - started, time.monotonic() - published, loaded)


def _keep_versions(versions: set[int], published: int, keep: int) -> set[int]:
    """The published version and the `keep - 1` newest older ones. Newer ones
    are from a timeline a resumed run abandoned."""
    older = sorted((v for v in versions if v < published), reverse=True)
    return {published, *older[: keep - 1]}


def _parse_version(name: str) -> int | None:
    match = _VERSION_RE.match(name)
    return int(match.group(1)) if match else None


class _LocalStore:
    def __init__(self, root: Path) -> None:
        self.root = root.absolute()

    def location(self, version: int) -> str:
        return str(self.root / version_dir_name(version))

    def publish(self, version: int, write: Callable[[Path], None], keep: int) -> str:
        name = version_dir_name(version)
        tmp = self.root / f"{_STAGING_PREFIX}{name}-{uuid.uuid4().hex[:8]}"
        try:
            write(tmp)
            if jax.process_index() == 0:
                install_directory(tmp, self.root / name)
                _replace_file(self.root / LATEST_FILE, name)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        if jax.process_index() == 0:
            self._collect(version, keep)
        return self.location(version)

    def _collect(self, published: int, keep: int) -> None:
        entries = {p.name: p for p in self.root.iterdir() if p.is_dir()}
        versions = {v for n in entries if (v := _parse_version(n)) is not None}
        kept = _keep_versions(versions, published, keep)
        for name, path in entries.items():
            version = _parse_version(name)
            # One publisher per root: any staging directory left now is a dead publish's.
            if name.startswith(_STAGING_PREFIX) or (version is not None and version not in kept):
                shutil.rmtree(path, ignore_errors=True)

    def latest(self) -> str | None:
        pointer = self.root / LATEST_FILE
        return str(self.root / pointer.read_text().strip()) if pointer.is_file() else None


def _replace_file(path: Path, text: str) -> None:
    tmp = path.with_name(f"{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    tmp.write_text(text + "\n")
    os.replace(tmp, path)


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

    def _delete_version(self, name: str) -> None:
        # Every key under "name/": "/" + 1 == "0" bounds the range.
        self._kv.delete_range(ts.KvStore.KeyRange(f"{name}/", f"{name}0")).result()

    def upload(self, key: str, path: Path) -> None:
        self._kv.write(key, path.read_bytes()).result()

    def publish(self, version: int, write: Callable[[Path], None], keep: int) -> str:
        name = version_dir_name(version)
        with tempfile.TemporaryDirectory(prefix="legorl-publish-") as staging:
            out = Path(staging) / name
            write(out)
            if jax.process_index() == 0:
                self._delete_version(name)  # leftovers of an earlier, torn upload of this version
                # One file in memory at a time; to_hf's shard size bounds it.
                for file in sorted(out.iterdir()):
                    self.upload(f"{name}/{file.name}", file)
                self._kv.write(LATEST_FILE, (name + "\n").encode()).result()
        if jax.process_index() == 0:
            self._collect(version, keep)
        return self.location(version)

    def _collect(self, published: int, keep: int) -> None:
        tops = {key.decode().split("/", 1)[0] for key in self._kv.list().result()}
        versions = {v for n in tops if (v := _parse_version(n)) is not None}
        for version in versions - _keep_versions(versions, published, keep):
            self._delete_version(version_dir_name(version))

    def latest(self) -> str | None:
        result = self._kv.read(LATEST_FILE).result()
        return f"{self.url}/{result.value.decode().strip()}" if result.state == "value" else None


class DirectoryPublisher:
    """Publishes HF safetensors to `root/v{version:08d}/`, keeping the newest `keep`.

    root: a local path, file:// URI, or a tensorstore kvstore URL (gs://...).
    dtype: the stored dtype (default: the parameters'); bfloat16 halves the
    bytes servers load. context: a `tensorstore.Context` for kvstore roots.
    Multi-host: every process calls `publish`; process 0 writes.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        keep: int = 3,
        tokenizer_from: str | os.PathLike[str] | None = None,
        dtype: DType | None = None,
        max_shard_bytes: int = DEFAULT_SHARD_BYTES,
        context: ts.Context | None = None,
    ) -> None:
        if keep < 1:
            raise ValueError(f"keep must be at least 1, got {keep}")
        if tokenizer_from is not None and not Path(tokenizer_from).is_dir():
            raise ValueError(f"tokenizer_from={tokenizer_from} is not a directory")
        root = os.fspath(root)
        self.keep = keep
        self._export: dict[str, Any] = dict(tokenizer_from=tokenizer_from, dtype=dtype, max_shard_bytes=max_shard_bytes)
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
        return self._store.publish(version, lambda out: to_hf(model, out, **self._export), self.keep)

    def latest(self) -> str | None:
        """Location of the newest completely published version, if any."""
        return self._store.latest()
