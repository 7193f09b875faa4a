"""One training job across the processes of a `jax.distributed` group.

Process 0 leads: it builds the demo model, drives the rollout fleet, evaluates
and writes the run's records. Every process trains: the leader `share`s what a
step needs (the trajectories to train on, the checkpoint to write) and the
others receive it, then all of them run the same collectives. `agree` checks
that every process derived the same thing (a packed batch, a restored state)
and stops the job on the first difference, so processes never train apart.

A message's header goes through the coordination service's key-value store: a
follower may wait minutes for the leader's rollouts, and a blocked collective
has no timeout of its own, while a key-value wait is cut into short polls that
a cancelled run leaves at once. Its payload then goes through a device
collective every process joins at once (the store is 25 times slower here,
docs/benchmarks.md). A dead process is found
by the service's heartbeats (`learner.heartbeat_timeout_s`), which end every
other process with an error naming it.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import pickle
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Protocol, TypeVar

import jax
import numpy as np
from jax.experimental import multihost_utils

log = logging.getLogger(__name__)
T = TypeVar("T")

_PREFIX = "legorl"
_MIN_BROADCAST = 1 << 16  # payloads are padded to a power of two from here: few shapes, few compilations
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
        client = self._client
        header = json.dumps({"tag": "abort", "reason": reason}).encode()
        try:
            await asyncio.to_thread(client.key_value_set_bytes, f"{_PREFIX}/msg/{self._sent}", header)
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
        blob = b"" if value is None else pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
        header = {"tag": tag, "size": len(blob), "sha256": hashlib.sha256(blob).hexdigest()}
        self._client.key_value_set_bytes(f"{_PREFIX}/msg/{seq}", json.dumps(header).encode())
        if blob:
            _broadcast(blob, len(blob))
            # Every follower joined that broadcast, so has read this header: it can go. (One with no
            # payload stays: nothing says when it was read; a run sends a few.)
            self._client.key_value_delete(f"{_PREFIX}/msg/{seq}")

    async def _receive(self, seq: int, tag: str) -> tuple[str, Any]:
        header = json.loads(await self._wait(f"{_PREFIX}/msg/{seq}", f"{tag!r} from process 0"))
        if header["tag"] == "abort":  # the reason rides in the header: an abort joins no collective
            return "abort", header["reason"]
        if not header["size"]:
            return header["tag"], None
        blob = await asyncio.to_thread(_broadcast, None, header["size"])
        if hashlib.sha256(blob).hexdigest() != header["sha256"]:
            raise DivergedError(f"{self}: message {seq} ({tag!r}) arrived corrupted")
        return header["tag"], pickle.loads(blob)

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
        if seq >= 2:  # every process posted seq-1, so is done reading seq-2
            self._client.key_value_delete(f"{_PREFIX}/agree/{seq - 2}/{self.index}")
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


def _broadcast(blob: bytes | None, size: int) -> bytes:
    """Process 0's `size` bytes on every process (`blob` there, None elsewhere), through a device
    collective: 25 times the key-value store's speed here (docs/benchmarks.md). Every process must
    call it, so it runs only once the header (read by polling) said a payload follows."""
    padded = max(_MIN_BROADCAST, 1 << (size - 1).bit_length())
    buffer = np.zeros(padded, np.uint8)
    if blob is not None:
        buffer[:size] = np.frombuffer(blob, np.uint8)
    return np.asarray(multihost_utils.broadcast_one_to_all(buffer))[:size].tobytes()
