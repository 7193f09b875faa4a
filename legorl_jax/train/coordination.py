"""One training job across the processes of a `jax.distributed` group.

Process 0 leads: it builds the demo model, drives the rollout fleet, evaluates
and writes the run's records. Every process trains: the leader `share`s what a
step needs (the trajectories to train on, the checkpoint to write) and the
others receive it, then all of them run the same collectives. `agree` checks
that every process derived the same thing (a packed batch, a restored state)
and stops the job on the first difference, so processes never train apart.

Messages go through the coordination service's key-value store rather than
device collectives: a follower may wait minutes for the leader's rollouts, and
a blocked collective has no timeout of its own, while a key-value wait is cut
into short polls that a cancelled run leaves at once. A dead process is found
by the service's heartbeats (`learner.heartbeat_timeout_s`), which end every
other process with an error naming it.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import pickle
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Protocol, TypeVar

import jax
import numpy as np

log = logging.getLogger(__name__)
T = TypeVar("T")

_PREFIX = "legorl"
_CHUNK_BYTES = 16 << 20  # well under the coordination service's gRPC message limit
_POLL_MS = 1000
_WAIT_LOG_S = 60.0
_AGREE_TIMEOUT_S = 600.0


class DivergedError(RuntimeError):
    """Processes of one job hold different values where they must hold the same."""


class LeaderStoppedError(RuntimeError):
    """Process 0 ended the run early; the followers stop with it."""


class ProcessFailedError(RuntimeError):
    """Another process of the job failed; this one stops too."""


class _KeyValueClient(Protocol):
    def key_value_set_bytes(self, key: str, value: bytes, allow_overwrite: bool = False) -> None: ...
    def blocking_key_value_get_bytes(self, key: str, timeout_in_ms: int) -> bytes: ...
    def key_value_delete(self, key: str) -> None: ...
    def key_value_dir_get_bytes(self, key: str) -> list[tuple[str, bytes]]: ...


def _client() -> _KeyValueClient:
    from jax._src import distributed  # the only handle on the coordination service's store

    client = distributed.global_state.client
    if client is None:
        raise RuntimeError("jax.distributed is not initialised: no coordination service to talk through")
    return client


def digest(*parts: Any) -> str:
    """A hex digest of arrays, bytes and JSON-like values, for `agree`."""
    h = hashlib.sha256()
    for part in parts:
        if isinstance(part, np.ndarray):
            h.update(f"{part.dtype}{part.shape}".encode())
            h.update(np.ascontiguousarray(part).tobytes())
        elif isinstance(part, bytes):
            h.update(part)
        else:
            h.update(repr(part).encode())
    return h.hexdigest()


class ProcessGroup:
    """The job's processes as the training loop sees them; one process is a group of one."""

    def __init__(self) -> None:
        self.index = jax.process_index()
        self.count = jax.process_count()
        self._sent = 0  # messages the leader sent, or a follower received
        self._checks = 0  # `agree` calls so far
        self._forgotten = 0  # the leader deleted every message before this one
        self._client = _client() if self.count > 1 else None

    @property
    def is_leader(self) -> bool:
        return self.index == 0

    def __repr__(self) -> str:
        return f"process {self.index} of {self.count}"

    # ---- messages from the leader -------------------------------------------
    async def share(self, tag: str, value: Any = None) -> Any:
        """The leader's `value` on every process: the leader passes it, followers get it.

        `tag` names what the message is, and must match on both sides: a follower
        that expects a step and gets an abort stops with the leader's reason."""
        if self._client is None:
            return value
        seq = self._sent
        self._sent += 1
        if self.is_leader:
            await asyncio.to_thread(self._send, seq, tag, value)
            return value
        got_tag, got = await self._receive(seq, tag)
        if got_tag == "abort":
            raise LeaderStoppedError(f"process 0 stopped the run: {got}")
        if got_tag != tag:
            raise DivergedError(f"{self}: expected message {tag!r} from process 0, got {got_tag!r}")
        return got

    async def leader_only(self, work: Callable[[], Awaitable[T]]) -> T | None:
        """Runs `work` on the leader while the others wait for it to end, so the job's processes
        leave together (JAX's shutdown waits only so long for the last one); None off the leader."""
        if not self.is_leader:
            await self.share("done")
            return None
        try:
            result = await work()
        except BaseException as exc:
            await self.abort(f"{type(exc).__name__}: {exc}")
            raise
        await self.share("done")
        return result

    async def abort(self, reason: str) -> None:
        """Tells the followers the leader ends the run early (best effort: the leader is failing)."""
        if self._client is None or not self.is_leader:
            return
        try:
            await asyncio.to_thread(self._send, self._sent, "abort", reason)
        except Exception:  # noqa: BLE001 - the run is already failing for a reason of its own
            log.exception("could not tell the other processes that the run stops")

    def report_failure(self, reason: str) -> None:
        """A follower's last word before it exits: the leader's `watch` stops the run with it."""
        if self._client is None or self.is_leader:
            return
        try:
            self._client.key_value_set_bytes(f"{_PREFIX}/failed/{self.index}", reason.encode(), allow_overwrite=True)
        except Exception:  # noqa: BLE001 - the heartbeat timeout still stops the job
            log.exception("could not tell process 0 that this process failed")

    async def watch(self) -> None:
        """On the leader, while the run lasts: raises `ProcessFailedError` once a follower reports a failure."""
        client = self._client
        if client is None or not self.is_leader:
            return
        while not (failed := await asyncio.to_thread(client.key_value_dir_get_bytes, f"{_PREFIX}/failed/")):
            await asyncio.sleep(_POLL_MS / 1000)
        key, reason = failed[0]
        error = ProcessFailedError(f"process {key.rsplit('/', 1)[-1]} stopped the run: {reason.decode()}")
        # Now: process 0 may be held in a collective the stopped process never joins, until the heartbeat timeout.
        log.error("%s; stopping", error)
        raise error

    def _send(self, seq: int, tag: str, value: Any) -> None:
        assert self._client is not None
        blob = pickle.dumps((tag, value), protocol=pickle.HIGHEST_PROTOCOL)
        chunks = [blob[i : i + _CHUNK_BYTES] for i in range(0, len(blob), _CHUNK_BYTES)] or [b""]
        base = f"{_PREFIX}/msg/{seq}"
        for i, chunk in enumerate(chunks):
            self._client.key_value_set_bytes(f"{base}/{i}", chunk)
        # The header last: a follower that sees it finds every chunk in place.
        header = f"{len(chunks)} {hashlib.sha256(blob).hexdigest()}".encode()
        self._client.key_value_set_bytes(base, header)
        self._forget_read()

    def _forget_read(self) -> None:
        """Deletes the messages every follower has acknowledged (each keeps its last in `ack/`)."""
        assert self._client is not None
        acks = self._client.key_value_dir_get_bytes(f"{_PREFIX}/ack/")
        if len(acks) < self.count - 1:
            return
        read = min(int(v) for _, v in acks)
        for seq in range(self._forgotten, read + 1):
            self._client.key_value_delete(f"{_PREFIX}/msg/{seq}")  # with its chunks under msg/{seq}/
        self._forgotten = max(self._forgotten, read + 1)

    async def _receive(self, seq: int, tag: str) -> tuple[str, Any]:
        base = f"{_PREFIX}/msg/{seq}"
        what = f"{tag!r} from process 0"
        header = await self._wait(base, what)
        count, sha = header.decode().split()
        blob = b"".join([await self._wait(f"{base}/{i}", what, timeout_s=60.0) for i in range(int(count))])
        if hashlib.sha256(blob).hexdigest() != sha:
            raise DivergedError(f"{self}: message {seq} ({tag!r}) arrived corrupted")
        assert self._client is not None
        self._client.key_value_set_bytes(f"{_PREFIX}/ack/{self.index}", str(seq).encode(), allow_overwrite=True)
        return pickle.loads(blob)

    def _poll(self, key: str, what: str) -> bytes | None:
        """The value of `key`, or None when it is not set within one poll."""
        assert self._client is not None
        try:
            return self._client.blocking_key_value_get_bytes(key, _POLL_MS)
        except Exception as exc:  # the store reports a poll that timed out as an error
            if "DEADLINE_EXCEEDED" in str(exc):
                return None
            raise RuntimeError(f"{self}: the coordination service failed waiting for {what}: {exc}") from exc

    async def _wait(self, key: str, what: str, timeout_s: float | None = None) -> bytes:
        """`key`'s value once set; polls in a worker thread, so a cancelled run stops waiting within a poll."""
        waited = _Waited(self, what, timeout_s)
        while (value := await asyncio.to_thread(self._poll, key, what)) is None:
            waited.tick()
        return value

    # ---- checks ----------------------------------------------------------------
    def agree(self, what: str, value: str) -> None:
        """Every process must hold the same `value` (a digest) for `what`; raises
        `DivergedError` naming the processes that differ from process 0.
        Blocking: call it where every process reaches it (in a worker thread from async code)."""
        if self._client is None:
            return
        seq = self._checks
        self._checks += 1
        base = f"{_PREFIX}/agree/{seq}"
        self._client.key_value_set_bytes(f"{base}/{self.index}", value.encode())
        values = {}
        for index in range(self.count):
            waited = _Waited(self, f"process {index}'s {what}", _AGREE_TIMEOUT_S)
            while (got := self._poll(f"{base}/{index}", what)) is None:
                waited.tick()
            values[index] = got.decode()
        differ = [i for i, v in values.items() if v != values[0]]
        if differ:
            raise DivergedError(
                f"{what} differs between processes: process 0 has {values[0]!r}, "
                + ", ".join(f"process {i} has {values[i]!r}" for i in differ)
            )


class _Waited:
    """A wait's clock: logs a long wait now and then, and gives up after `timeout_s` (None: never)."""

    def __init__(self, group: ProcessGroup, what: str, timeout_s: float | None) -> None:
        self.group, self.what, self.timeout_s = group, what, timeout_s
        self.started = self.logged = time.monotonic()

    def tick(self) -> None:
        now = time.monotonic()
        if self.timeout_s is not None and now - self.started > self.timeout_s:
            raise DivergedError(f"{self.group}: no {self.what} after {self.timeout_s:.0f} s")
        if now - self.logged > _WAIT_LOG_S:
            log.info("%s: waiting for %s (%.0f s)", self.group, self.what, now - self.started)
            self.logged = now


def directory_digest(directory: Path) -> str:
    """A digest of a model directory's files (names and bytes), read in 16 MiB blocks."""
    h = hashlib.sha256()
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        h.update(str(path.relative_to(directory)).encode() + b"\0")
        with path.open("rb") as f:
            while block := f.read(16 << 20):
                h.update(block)
    return h.hexdigest()
