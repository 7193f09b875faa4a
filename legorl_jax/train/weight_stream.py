"""Weights over gRPC for fleets without shared storage: `WeightStreamer` sends a
published version to every rollout server with `StreamWeights`, to each
directly or once down a relay chain of the servers (`rollout_server.weight_relay`).
A delta version (`legorl_jax.core.weight_delta`) travels as a header naming its
base and its blob in chunks; a server that does not serve the base gets the
last full checkpoint and the deltas since. An adapter version (a LoRA run's)
travels as a header with its manifest and `adapter_config.json`, then
`adapter_model.safetensors` in chunks of the same `delta` payload.

A full stream is a header (every small file of the directory, and always a
safetensors index, synthesised for single-file checkpoints, so the receiver
knows the full tensor list up front) followed by each tensor in chunks, file
by file. Tensors are read one at a time from the memory-mapped safetensors
files and sent as raw little-endian bytes under their safetensors dtype name:
bfloat16 crosses unchanged, and the sender never holds more than one tensor.
Chunks fit gRPC's default 4 MiB message limit; the header carries the
tokenizer files whole, so a server for a large-vocabulary tokenizer (Qwen3's
tokenizer.json is ~11 MB) must raise `grpc.max_receive_message_length`.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from safetensors import safe_open

from legorl_jax.core.grpc_auth import ClientSecurity
from legorl_jax.core.weight_layout import (
    ADAPTER_CONFIG_FILE,
    ADAPTER_WEIGHTS_FILE,
    DELTA_FILE,
    INDEX_FILE,
    MANIFEST_FILE,
    read_manifest,
    version_dir_name,
)
from protos.legorl.v1 import rollout_pb2 as pb
from protos.legorl.v1 import rollout_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

# gRPC servers refuse messages over 4 MiB by default; leave room for the
# chunk's name, shape and framing.
DEFAULT_CHUNK_BYTES = 4 * 2**20 - 64 * 2**10


class WeightStreamError(RuntimeError):
    """No server loaded the streamed weights, or the directory cannot be streamed."""


def _local_directory(location: str) -> Path:
    if "://" in location and not location.startswith("file://"):
        raise WeightStreamError(f"{location}: only a local directory can be streamed; publish to a local path")
    directory = Path(location.removeprefix("file://"))
    if not any((directory / f).is_file() for f in ("config.json", DELTA_FILE, ADAPTER_CONFIG_FILE)):
        raise WeightStreamError(
            f"{location}: neither config.json, {DELTA_FILE} nor {ADAPTER_CONFIG_FILE} there; not a published version"
        )
    return directory


def _weight_map(directory: Path) -> dict[str, Any]:
    """The directory's safetensors index, built for a single-file checkpoint."""
    index = directory / INDEX_FILE
    if index.is_file():
        return json.loads(index.read_text())
    single = directory / "model.safetensors"
    if not single.is_file():
        raise WeightStreamError(f"{directory}: neither model.safetensors nor {INDEX_FILE}")
    with safe_open(single, "numpy") as f:
        return {"weight_map": dict.fromkeys(f.keys(), single.name)}


def weight_chunks(
    directory: Path,
    version: int,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    relay_to: Sequence[str] = (),
    *,
    full: bool = False,
) -> Iterator[pb.WeightChunk]:
    """The `StreamWeights` messages for one published version, lazily: its
    delta blob in chunks when it has one (unless `full`), else the HF
    directory tensor by tensor."""
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    whole = (directory / ADAPTER_CONFIG_FILE).is_file()  # an adapter: its files whole, its tensors as a blob
    if whole or (not full and (directory / DELTA_FILE).is_file()):
        sides = (MANIFEST_FILE, ADAPTER_CONFIG_FILE) if whole else (MANIFEST_FILE,)
        files = {name: (directory / name).read_bytes() for name in sides}
        header = pb.WeightHeader(version=version, files=files, delta=not whole, relay_to=relay_to)
        yield pb.WeightChunk(header=header)
        blob = (directory / (ADAPTER_WEIGHTS_FILE if whole else DELTA_FILE)).read_bytes()
        for offset in range(0, len(blob), chunk_bytes):
            yield pb.WeightChunk(delta=blob[offset : offset + chunk_bytes])
        return
    index = _weight_map(directory)
    files = {
        p.name: p.read_bytes()
        for p in sorted(directory.iterdir())
        if p.is_file() and not p.name.endswith(".safetensors") and p.name not in (INDEX_FILE, DELTA_FILE)
    }
    files[INDEX_FILE] = json.dumps(index).encode()
    yield pb.WeightChunk(header=pb.WeightHeader(version=version, files=files, relay_to=relay_to))
    by_file: dict[str, list[str]] = {}
    for name, file in index["weight_map"].items():
        by_file.setdefault(file, []).append(name)
    for file, names in by_file.items():
        with safe_open(directory / file, "numpy") as f:
            for name in names:
                dtype = f.get_slice(name).get_dtype()
                tensor = np.ascontiguousarray(f.get_tensor(name))
                raw = tensor.reshape(-1).view(np.uint8).data
                # A zero-size tensor still needs one (empty) chunk to be announced.
                for offset in range(0, max(len(raw), 1), chunk_bytes):
                    yield pb.WeightChunk(
                        tensor=pb.TensorChunk(
                            name=name,
                            dtype=dtype,
                            shape=tensor.shape,
                            offset=offset,
                            data=bytes(raw[offset : offset + chunk_bytes]),
                        )
                    )


async def _in_thread(chunks: Iterator[pb.WeightChunk]) -> AsyncIterator[pb.WeightChunk]:
    """Reads from disk off the event loop, one message ahead of gRPC."""
    while (chunk := await asyncio.to_thread(next, chunks, None)) is not None:
        yield chunk


def delta_chain(directory: Path) -> list[Path]:
    """The published directories a host without any of them needs for `directory`:
    the last full checkpoint up to it, then each delta after that."""
    chain = [directory]
    while not (chain[0] / "config.json").is_file() and not (chain[0] / ADAPTER_CONFIG_FILE).is_file():
        manifest = read_manifest(chain[0])
        if manifest is None or manifest.base_version is None:
            raise WeightStreamError(f"{chain[0]} is neither a full checkpoint nor a delta")
        base = chain[0].parent / version_dir_name(manifest.base_version)
        if not base.is_dir():
            raise WeightStreamError(f"{chain[0]} is a delta on version {manifest.base_version}, no longer published")
        chain.insert(0, base)
    return chain


class WeightStreamer:
    """`WeightSubscribers` for a fleet without shared storage: streams a local
    published directory to every address and returns address -> loaded version.

    relay=False sends each server its own stream; relay=True sends one stream
    to the first server, which relays it down the chain of the others
    (`rollout_server.weight_relay`), so the learner's link carries each
    version once. Either way a server that cannot take a delta (it missed
    versions, or a relay before it failed) then gets the last full checkpoint
    and the deltas since, directly. A server that fails is logged and left
    out; none loading is an error."""

    def __init__(
        self,
        addresses: Sequence[str],
        *,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        timeout_s: float = 600.0,
        security: ClientSecurity = ClientSecurity(),
        relay: bool = False,
    ) -> None:
        if not addresses:
            raise ValueError("WeightStreamer needs at least one server address")
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
        self.addresses = list(addresses)
        self.chunk_bytes = chunk_bytes
        self.timeout_s = timeout_s
        self.security = security
        self.relay = relay
        # Per server, the probe difference its last direct StreamWeights reported (rollout.proto).
        self.probe_diffs: dict[str, float] = {}

    async def _send(
        self, address: str, directory: Path, version: int, relay_to: Sequence[str] = (), *, full: bool = False
    ) -> int:
        async with self.security.channel(address) as channel:
            stub = pb_grpc.RolloutServiceStub(channel)
            chunks = _in_thread(weight_chunks(directory, version, self.chunk_bytes, relay_to, full=full))
            reply = await stub.StreamWeights(chunks, timeout=self.timeout_s, metadata=self.security.metadata)
        self.probe_diffs[address] = reply.probe_max_abs_diff
        return reply.loaded_version

    async def _send_or_catch_up(self, address: str, directory: Path, version: int) -> int:
        try:
            return await self._send(address, directory, version)
        except grpc.aio.AioRpcError as exc:
            # An adapter refused is one for another base: the host holds no base that a catch-up could send.
            if (directory / ADAPTER_CONFIG_FILE).is_file():
                raise
            if exc.code() != grpc.StatusCode.FAILED_PRECONDITION and not await self._may_lack_base(address, directory):
                raise
        log.info("%s did not take version %d; sending it the last full checkpoint and deltas", address, version)
        chain = delta_chain(directory)
        loaded = await self._send(address, chain[0], _version_of(chain[0]), full=True)
        for step in chain[1:]:
            loaded = await self._send(address, step, _version_of(step))
        return loaded

    async def _may_lack_base(self, address: str, directory: Path) -> bool:
        """Whether a failed send of `directory` may have been a refused delta.

        A server refuses a delta on a base it does not hold at the first
        message, before the client has sent the rest; grpcio's asyncio client
        can then report its own failed write as INTERNAL "Internal error from
        Core" instead of the server's FAILED_PRECONDITION (grpc/grpc#36066).
        So any failed delta to a server that still answers is worth one catch-up
        (if the cause was another, the catch-up fails too and says so); a
        server that does not answer is left out."""
        manifest = read_manifest(directory)
        if manifest is None or manifest.base_version is None:
            return False
        return await self._served(address) is not None

    async def _served(self, address: str) -> int | None:
        try:
            async with self.security.channel(address) as channel:
                status = await pb_grpc.RolloutServiceStub(channel).GetStatus(
                    pb.GetStatusRequest(), timeout=10.0, metadata=self.security.metadata
                )
        except grpc.aio.AioRpcError:
            return None
        return status.loaded_policy_version

    async def update_weights(self, version: int, location: str) -> dict[str, int]:
        self.probe_diffs = {}
        directory = _local_directory(location)
        behind = self.addresses
        if self.relay:
            try:
                await self._send(self.addresses[0], directory, version, relay_to=self.addresses[1:])
            except grpc.aio.AioRpcError as exc:
                log.warning("StreamWeights relay from %s failed: %s", self.addresses[0], exc.details())
            # What each server serves now, not what the chain said: a relay may have failed anywhere.
            served = await asyncio.gather(*(self._served(a) for a in self.addresses))
            behind = [a for a, v in zip(self.addresses, served, strict=True) if v != version]
        results = await asyncio.gather(
            *(self._send_or_catch_up(a, directory, version) for a in behind), return_exceptions=True
        )
        loaded = {a: version for a in self.addresses if a not in behind}
        failures: list[str] = []
        for address, result in zip(behind, results, strict=True):
            if isinstance(result, BaseException):
                detail = result.details() if isinstance(result, grpc.aio.AioRpcError) else repr(result)
                log.warning("StreamWeights to %s failed: %s", address, detail)
                failures.append(f"{address}: {detail}")
            else:
                loaded[address] = result
        if not loaded:
            raise WeightStreamError(f"no server loaded policy version {version}: {'; '.join(failures)}")
        return loaded


def _version_of(directory: Path) -> int:
    manifest = read_manifest(directory)
    if manifest is None:
        raise WeightStreamError(f"{directory} has no manifest; cannot tell its version")
    return manifest.version
