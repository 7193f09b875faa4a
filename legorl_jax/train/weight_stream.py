"""Weights over gRPC for fleets without shared storage: `WeightStreamer` sends a
published HF directory to every rollout server with `StreamWeights`.

The stream is a header (every small file of the directory, and always a
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

from legorl_jax.grpc_auth import ClientSecurity
from protos.legorl.v1 import rollout_pb2 as pb
from protos.legorl.v1 import rollout_pb2_grpc as pb_grpc
from rollout_server.weights import INDEX_FILE

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
    if not (directory / "config.json").is_file():
        raise WeightStreamError(f"{location}: no config.json there; not an HF weights directory")
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


def weight_chunks(directory: Path, version: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[pb.WeightChunk]:
    """The `StreamWeights` messages for one HF directory, lazily."""
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    index = _weight_map(directory)
    files = {
        p.name: p.read_bytes()
        for p in sorted(directory.iterdir())
        if p.is_file() and not p.name.endswith(".safetensors") and p.name != INDEX_FILE
    }
    files[INDEX_FILE] = json.dumps(index).encode()
    yield pb.WeightChunk(header=pb.WeightHeader(version=version, files=files))
    by_file: dict[str, list[str]] = {}
    for name, file in index["weight_map"].items():
        by_file.setdefault(file, []).append(name)
    for file, names in by_file.items():
        with safe_open(directory / file, "numpy") as f:
            for name in names:
                dtype = f.get_slice(name).get_dtype()
                tensor = np.ascontiguousarray(f.get_tensor(name))
                raw = memoryview(tensor.reshape(-1).view(np.uint8))
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


class WeightStreamer:
    """`WeightSubscribers` for a fleet without shared storage: streams a local
    published directory to every address and returns address -> loaded version.
    A server that fails is logged and left out; none loading is an error."""

    def __init__(
        self,
        addresses: Sequence[str],
        *,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        timeout_s: float = 600.0,
        security: ClientSecurity = ClientSecurity(),
    ) -> None:
        if not addresses:
            raise ValueError("WeightStreamer needs at least one server address")
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
        self.addresses = list(addresses)
        self.chunk_bytes = chunk_bytes
        self.timeout_s = timeout_s
        self.security = security

    async def _send(self, address: str, directory: Path, version: int) -> int:
        async with self.security.channel(address) as channel:
            stub = pb_grpc.RolloutServiceStub(channel)
            chunks = _in_thread(weight_chunks(directory, version, self.chunk_bytes))
            reply = await stub.StreamWeights(chunks, timeout=self.timeout_s, metadata=self.security.metadata)
        return reply.loaded_version

    async def update_weights(self, version: int, location: str) -> dict[str, int]:
        directory = _local_directory(location)
        results = await asyncio.gather(
            *(self._send(a, directory, version) for a in self.addresses), return_exceptions=True
        )
        loaded: dict[str, int] = {}
        failures: list[str] = []
        for address, result in zip(self.addresses, results, strict=True):
            if isinstance(result, BaseException):
                detail = result.details() if isinstance(result, grpc.aio.AioRpcError) else repr(result)
                log.warning("StreamWeights to %s failed: %s", address, detail)
                failures.append(f"{address}: {detail}")
            else:
                loaded[address] = result
        if not loaded:
            raise WeightStreamError(f"no server loaded policy version {version}: {'; '.join(failures)}")
        return loaded
