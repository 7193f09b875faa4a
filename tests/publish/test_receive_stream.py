"""The rollout host's receiver against broken senders: every malformed stream
is a WeightTransferError that says what was wrong, and leaves nothing behind;
plus `resolve_location` on local locations."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Iterable
from pathlib import Path

import pytest

from legorl_jax.core.weight_layout import INDEX_FILE, WeightTransferError
from legorl_jax.models import CausalLM
from legorl_jax.train.publish import DirectoryPublisher
from legorl_jax.train.weight_stream import weight_chunks
from protos.legorl.v1 import rollout_pb2 as pb
from rollout_server.weights import WeightStreamStalled, receive_stream, resolve_location

Messages = list[pb.WeightChunk]


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory, model: CausalLM) -> Messages:
    location = DirectoryPublisher(tmp_path_factory.mktemp("w"), max_shard_bytes=16 * 2**10).publish(model, 4)
    return list(weight_chunks(Path(location), 4, chunk_bytes=700))


async def feed(messages: Iterable[pb.WeightChunk], fail: Exception | None = None) -> AsyncIterator[pb.WeightChunk]:
    for message in messages:
        yield message
    if fail is not None:
        raise fail


def receive(messages: Iterable[pb.WeightChunk], root: Path, fail: Exception | None = None) -> tuple[int, Path]:
    return asyncio.run(receive_stream(feed(messages, fail), root))


def header_with(good: Messages, files: dict[str, bytes | None]) -> pb.WeightChunk:
    """The good header with `files` replaced (None: removed)."""
    header = pb.WeightChunk()
    header.CopyFrom(good[0])
    for name, data in files.items():
        if data is None:
            del header.header.files[name]
        else:
            header.header.files[name] = data
    return header


def edited(message: pb.WeightChunk, **fields: object) -> pb.WeightChunk:
    out = pb.WeightChunk()
    out.CopyFrom(message)
    for key, value in fields.items():
        if key == "shape":
            del out.tensor.shape[:]
            out.tensor.shape.extend(value)  # type: ignore[arg-type]
        else:
            setattr(out.tensor, key, value)
    return out


def with_header(good: Messages, files: dict[str, bytes | None]) -> Messages:
    return [header_with(good, files), *good[1:]]


def replaced(good: Messages, at: int, message: pb.WeightChunk) -> Messages:
    at %= len(good)
    return [*good[:at], message, *good[at + 1 :]]


def first_multi_chunk(good: Messages) -> int:
    """Index of the first chunk of a tensor that spans several."""
    return next(i for i in range(1, len(good) - 1) if good[i].tensor.name == good[i + 1].tensor.name)


def shape_changes_mid_tensor(good: Messages) -> Messages:
    second = first_multi_chunk(good) + 1
    return replaced(good, second, edited(good[second], shape=[7, 7]))


def chunks_swapped(good: Messages) -> Messages:
    first = first_multi_chunk(good)
    return [*good[:first], good[first + 1], good[first], *good[first + 2 :]]


def index_with(good: Messages, **changes: object) -> bytes:
    return json.dumps({**json.loads(good[0].header.files[INDEX_FILE]), **changes}).encode()


CORRUPTIONS: dict[str, tuple[Callable[[Messages], Messages], str]] = {
    "empty stream": (lambda g: [], "must start with a header"),
    "missing header": (lambda g: g[1:], "must start with a header"),
    "second header": (lambda g: [*g[:3], g[0], *g[3:]], "only the first message"),
    "no index in header": (lambda g: with_header(g, {INDEX_FILE: None}), "lacks model.safetensors.index.json"),
    "no config in header": (lambda g: with_header(g, {"config.json": None}), "lacks config.json"),
    "garbled index": (lambda g: with_header(g, {INDEX_FILE: b"{not json"}), "not a safetensors index"),
    "path in header file name": (lambda g: with_header(g, {"../evil": b"x"}), "not a plain file name"),
    "tensor file in header": (lambda g: with_header(g, {"model.safetensors": b"x"}), "tensors travel only as chunks"),
    "index escapes the directory": (
        lambda g: with_header(g, {INDEX_FILE: index_with(g, weight_map={"a": "../a.safetensors"})}),
        "not a plain file name",
    ),
    "wrong total size": (
        lambda g: with_header(g, {INDEX_FILE: index_with(g, metadata={"total_size": 12345})}),
        "12345 bytes in total",
    ),
    "index nested deeper than JSON parses": (
        lambda g: with_header(g, {INDEX_FILE: b"[" * 100_000}),
        "not a safetensors index",
    ),
    "index maps a tensor to a number": (
        lambda g: with_header(g, {INDEX_FILE: index_with(g, weight_map={"a": 3})}),
        "not a safetensors index",
    ),
    "total size not a byte count": (
        lambda g: with_header(g, {INDEX_FILE: index_with(g, metadata={"total_size": "many"})}),
        "not a byte count",
    ),
    "total size beyond the disk": (
        lambda g: with_header(g, {INDEX_FILE: index_with(g, metadata={"total_size": 2**70})}),
        "free on disk",
    ),
    # A shape is sized before anything is allocated: numpy would fail (or reserve terabytes) on these.
    "tensor shape of 2^40 elements": (
        lambda g: replaced(g, 1, edited(g[1], shape=[2**40])),
        "needs [0-9]+ bytes; .* exceeds the",
    ),
    "tensor shape of 2^40 elements, no total size in the index": (
        lambda g: replaced(with_header(g, {INDEX_FILE: index_with(g, metadata={})}), 1, edited(g[1], shape=[2**40])),
        "needs [0-9]+ bytes; .* exceeds the",
    ),
    "tensor shape past 64 bits": (
        lambda g: replaced(g, 1, edited(g[1], shape=[2**63, 2**63])),
        "needs [0-9]+ bytes; .* exceeds the",
    ),
    "name not in index": (lambda g: replaced(g, 2, edited(g[2], name="model.sneaky")), "not in the header's index"),
    "unknown dtype": (lambda g: replaced(g, 1, edited(g[1], dtype="Q4")), "unknown safetensors dtype"),
    "too many bytes": (lambda g: replaced(g, -1, edited(g[-1], data=g[-1].tensor.data + bytes(4096))), "bytes sent"),
    "shape changes mid-tensor": (shape_changes_mid_tensor, "earlier chunks"),
    "chunk out of order": (chunks_swapped, "expected 0"),
    "tensor sent twice": (lambda g: [*g, g[-1]], "already received"),
    "truncated": (lambda g: g[:-1], "incomplete or missing"),
}


def test_good_stream_is_received(good: Messages, tmp_path: Path) -> None:
    version, directory = receive(good, tmp_path)
    assert (version, directory) == (4, tmp_path / "v00000004")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v00000004"]


@pytest.mark.parametrize("case", sorted(CORRUPTIONS))
def test_corrupt_stream_is_a_clear_error_and_writes_nothing(good: Messages, tmp_path: Path, case: str) -> None:
    corrupt, message = CORRUPTIONS[case]
    with pytest.raises(WeightTransferError, match=message):
        receive(corrupt(good), tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_sender_dying_mid_stream_writes_nothing(good: Messages, tmp_path: Path) -> None:
    with pytest.raises(ConnectionResetError):
        receive(good[: len(good) // 2], tmp_path, fail=ConnectionResetError("client went away"))
    assert list(tmp_path.iterdir()) == []


def test_sender_going_quiet_is_dropped_after_the_idle_timeout(good: Messages, tmp_path: Path) -> None:
    async def stalls() -> AsyncIterator[pb.WeightChunk]:
        for message in good[:3]:
            yield message
        await asyncio.Event().wait()  # a client that stopped sending but keeps the call open

    async def main() -> None:
        with pytest.raises(WeightStreamStalled, match="sent nothing for 0.2 s"):
            await asyncio.wait_for(receive_stream(stalls(), tmp_path, idle_timeout_s=0.2), 10)

    asyncio.run(main())
    assert list(tmp_path.iterdir()) == []


def test_received_versions_are_pruned_to_keep(good: Messages, tmp_path: Path) -> None:
    for version in (1, 2, 3):
        header = header_with(good, {})
        header.header.version = version
        asyncio.run(receive_stream(feed([header, *good[1:]]), tmp_path, keep=2))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v00000002", "v00000003"]


def test_resolve_local_locations(good: Messages, tmp_path: Path) -> None:
    _, directory = receive(good, tmp_path / "recv")
    assert resolve_location(str(directory), tmp_path / "cache") == directory
    assert resolve_location(f"file://{directory}", tmp_path / "cache") == directory
    with pytest.raises(WeightTransferError, match="empty"):
        resolve_location("", tmp_path / "cache")
    with pytest.raises(WeightTransferError, match="no config.json"):
        resolve_location(str(tmp_path), tmp_path / "cache")
    # Only the kvstore schemes a publisher writes: tensorstore opens http(s):// too, then fails to list it.
    for location in ("nosuchscheme://bucket/v00000001", "http://127.0.0.1:1/w/v1", "https://example.com/w/v1"):
        with pytest.raises(WeightTransferError, match="is not supported; use a local path"):
            resolve_location(location, tmp_path / "cache")
    with pytest.raises(WeightTransferError, match="nul.*byte"):
        resolve_location("/tmp/nul\0byte", tmp_path / "cache")
    assert not (tmp_path / "cache").exists()
