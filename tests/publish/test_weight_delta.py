"""Delta versions: bit-exact reconstruction (checked by digest against a full
publish of the same weights), torn or mismatched deltas refused before any
write, hosts that missed versions catching up from the last full checkpoint."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import os
import struct
from collections.abc import AsyncIterator, Iterable
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from legorl_jax.core.weight_delta import (
    MAGIC,
    BaseMismatch,
    DeltaError,
    apply_delta,
    encode_delta,
    patch,
    read_header,
    weights_digest,
)
from legorl_jax.core.weight_layout import WeightTransferError, read_manifest, read_tensors
from legorl_jax.models import CausalLM
from legorl_jax.train.publish import DirectoryPublisher
from legorl_jax.train.weight_stream import weight_chunks
from protos.legorl.v1 import rollout_pb2 as pb
from rollout_server.weights import WeightBaseMismatch, receive_stream, resolve_location


def nudged(model: CausalLM, seed: int, lr: float = 1e-3) -> CausalLM:
    """`model` after an update of relative size `lr`: in bf16 only some elements change."""
    graph, state = nnx.split(model)
    keys = iter(jax.random.split(jax.random.key(seed), 1000))
    state = jax.tree.map(lambda x: x * (1 + lr * jax.random.normal(next(keys), x.shape, x.dtype)), state)
    return nnx.merge(graph, state)


def same_bits(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and a[k].tobytes() == b[k].tobytes() for k in a)


def bf16_pair() -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    old = {f"w{i}": rng.standard_normal((64, 48)).astype(ml_dtypes.bfloat16) for i in range(3)}
    old["w0"].reshape(-1)[:3] = [np.nan, -0.0, np.inf]
    new = {k: v.copy() for k, v in old.items()}
    new["w0"].reshape(-1)[:3] = [0.0, 0.0, -np.inf]  # -0.0 -> 0.0 compares equal as values, not as bits
    new["w1"].reshape(-1)[rng.choice(new["w1"].size, 50, replace=False)] += ml_dtypes.bfloat16(0.5)
    return old, new


def delta_of(old: dict[str, np.ndarray], new: dict[str, np.ndarray]) -> bytes:
    """The delta from version 1 (`old`) to version 2 (`new`)."""
    digests = {"base_digest": weights_digest(old), "digest": weights_digest(new)}
    return encode_delta(old, new, base_version=1, version=2, **digests)


def test_delta_rebuilds_the_exact_bits() -> None:
    old, new = bf16_pair()
    blob = delta_of(old, new)
    header = read_header(blob)
    assert header.changed == 53 and header.total == 3 * 64 * 48
    base = {k: v.copy() for k, v in old.items()}
    apply_delta(base, blob, weights_digest(old))
    assert same_bits(base, new)


@pytest.mark.parametrize("damage", ["truncated", "flipped", "wrong base"])
def test_bad_delta_is_refused_and_leaves_the_base_alone(damage: str) -> None:
    old, new = bf16_pair()
    blob = delta_of(old, new)
    base = {k: v.copy() for k, v in old.items()}
    digest = weights_digest(old)
    if damage == "truncated":
        blob = blob[: len(blob) // 2]
    elif damage == "flipped":
        blob = blob[:100] + bytes([blob[100] ^ 1]) + blob[101:]
    else:
        digest = weights_digest(new)
    with pytest.raises(BaseMismatch if damage == "wrong base" else DeltaError):
        apply_delta(base, blob, digest)
    assert same_bits(base, old)


def resealed(blob: bytes, name: str, part: bytes, changed: int | None = None) -> bytes:
    """`blob` with tensor `name`'s encoded part (and changed count) replaced, framing and
    checksum made valid again: what a sender with a bug, or a hostile one, could send."""
    view = memoryview(blob)
    start = len(MAGIC) + 8
    header = read_header(blob)
    offset = start + struct.unpack("<Q", view[len(MAGIC) : start])[0]
    parts = []
    for spec in header.tensors:
        parts.append(bytes(view[offset : offset + spec["nbytes"]]))
        offset += spec["nbytes"]
        if spec["name"] == name:
            parts[-1] = part
            spec.update(nbytes=len(part), changed=spec["changed"] if changed is None else changed)
    raw = json.dumps(dataclasses.asdict(header)).encode()
    body = b"".join([MAGIC, struct.pack("<Q", len(raw)), raw, *parts])
    return body + hashlib.sha256(body).digest()


def varints(*values: int) -> bytes:
    out = bytearray()
    for value in values:
        while value >= 0x80:
            out.append(value & 0x7F | 0x80)
            value >>= 7
        out.append(value)
    return bytes(out)


SIZE = 64 * 48  # elements of each tensor of bf16_pair
CRAFTED = {
    # name: (encoded part of w1, its changed count, what the refusal says)
    "position past the end": (varints(SIZE + 1, 1), 1, "out of order or out of range"),
    "positions summing past the end": (varints(SIZE, 5, 1, 1), 2, "out of order or out of range"),
    "a gap of zero": (varints(3, 0, 1, 1), 2, "out of order or out of range"),
    "a gap wrapping 64 bits": (varints(3, 2**64 - 2, 1, 1), 2, "out of order or out of range"),
    "a change of no bits": (varints(3, 0), 1, "flips no bits"),
    "a change wider than bf16": (varints(3, 1 << 16), 1, "more bits than"),
    "a value cut off": (bytes([0x83]), 1, "do not hold"),
    "fewer values than changes": (varints(3, 1), 2, "do not hold"),
    "more values than changes": (varints(3, 1, 1), 1, "do not hold"),
    "a varint of 11 bytes": (bytes([0x80] * 10 + [1]) + varints(1), 1, "longer than"),
    "more changes than elements": (varints(1, 1), SIZE + 1, "changes in a tensor of"),
}


@pytest.mark.parametrize("case", sorted(CRAFTED))
def test_crafted_delta_is_refused_and_leaves_the_base_alone(case: str) -> None:
    """A delta whose checksum is right but whose content is not: refused before any element is written."""
    old, new = bf16_pair()
    part, changed, says = CRAFTED[case]
    blob = resealed(delta_of(old, new), "w1", part, changed)
    base = {k: v.copy() for k, v in old.items()}
    with pytest.raises(DeltaError, match=says):
        apply_delta(base, blob, weights_digest(old))
    assert same_bits(base, old)


def test_a_well_formed_crafted_delta_is_applied_exactly() -> None:
    """The encoding by hand: position 2 (gap 3) gets bit 0 flipped, position 130 (gap 128, two bytes) bit 15."""
    old, _ = bf16_pair()
    blob = resealed(delta_of(old, old), "w1", varints(3, 128, 1, 1 << 15), 2)
    base = {k: v.copy() for k, v in old.items()}
    patch(base, blob, weights_digest(old))
    bits, was = base["w1"].reshape(-1).view(np.uint16), old["w1"].reshape(-1).view(np.uint16)
    assert np.flatnonzero(bits != was).tolist() == [2, 130]
    assert (bits[2] ^ was[2], bits[130] ^ was[130]) == (1, 1 << 15)


Published = tuple[Path, Path, list[CausalLM]]


@pytest.fixture
def published(tmp_path: Path, model: CausalLM) -> Published:
    """Versions 0..4 with a full checkpoint every 3 (0 and 3 also full, 1..4
    deltas) and the same models published in full alone, as the reference."""
    models = [model]
    for step in range(1, 5):
        models.append(nudged(models[-1], step))
    deltas = DirectoryPublisher(tmp_path / "deltas", keep=2, dtype="bfloat16", full_every=3)
    fulls = DirectoryPublisher(tmp_path / "fulls", keep=5, dtype="bfloat16")
    kinds = []
    for version, m in enumerate(models):
        deltas.publish(m, version)
        fulls.publish(m, version)
        assert deltas.last is not None
        kinds.append(deltas.last.kind)
        assert 0 < deltas.last.changed_fraction <= 1
    assert kinds == ["full", "delta", "delta", "delta+full", "delta"]
    return tmp_path / "deltas", tmp_path / "fulls", models


def test_published_deltas_rebuild_what_a_full_publish_stores(published: Published, tmp_path: Path) -> None:
    deltas, fulls, _ = published
    # keep=2, but the chain back to the last full checkpoint (3) stays.
    assert sorted(p.name for p in deltas.iterdir() if p.is_dir()) == ["v00000003", "v00000004"]
    host = tmp_path / "host"
    current = resolve_location(str(deltas / "v00000003"), host)
    assert current == deltas / "v00000003"  # a fresh host takes the full checkpoint beside the delta
    rebuilt = resolve_location(str(deltas / "v00000004"), host, current=current)
    assert same_bits(read_tensors(rebuilt), read_tensors(fulls / "v00000004"))
    manifest = read_manifest(rebuilt)
    reference = read_manifest(fulls / "v00000004")
    assert manifest is not None and reference is not None and manifest.digest == reference.digest
    assert (rebuilt / "config.json").is_file()


def test_a_host_in_step_takes_the_delta_beside_a_full_checkpoint(published: Published, tmp_path: Path) -> None:
    deltas, fulls, _ = published
    host = tmp_path / "host"
    current = resolve_location(str(fulls / "v00000002"), host)  # what the host serves: version 2, in full
    got = resolve_location(str(deltas / "v00000003"), host, current=current)
    assert got.parent == host and same_bits(read_tensors(got), read_tensors(fulls / "v00000003"))


def test_a_host_that_missed_versions_catches_up_from_the_last_full(tmp_path: Path, model: CausalLM) -> None:
    root = tmp_path / "pub"
    publisher = DirectoryPublisher(root, keep=1, dtype="bfloat16", full_every=4)
    models = [model, nudged(model, 1), nudged(nudged(model, 1), 2)]
    for version, m in enumerate(models):
        publisher.publish(m, version)
    reference = DirectoryPublisher(tmp_path / "ref", dtype="bfloat16")
    reference.publish(models[2], 2)
    # A fresh host (nothing served) and one that serves version 0 and missed 1.
    for current in (None, resolve_location(str(root / "v00000000"), tmp_path / "h0")):
        got = resolve_location(str(root / "v00000002"), tmp_path / "h1", current=current)
        assert same_bits(read_tensors(got), read_tensors(tmp_path / "ref" / "v00000002"))


def versions(count: int, model: CausalLM, tmp_path: Path, full_every: int) -> tuple[Path, Path]:
    """Versions 0..count-1 of small updates, published with deltas and, as the reference, in full."""
    pub = DirectoryPublisher(tmp_path / "pub", keep=count, dtype="bfloat16", full_every=full_every)
    ref = DirectoryPublisher(tmp_path / "ref", keep=count, dtype="bfloat16")
    for version in range(count):
        model = nudged(model, version) if version else model
        pub.publish(model, version)
        ref.publish(model, version)
    return tmp_path / "pub", tmp_path / "ref"


def test_a_catching_up_host_keeps_the_directory_it_serves(tmp_path: Path, model: CausalLM) -> None:
    """Catching up installs several versions before the engine moves; the one it serves
    from must stay whole meanwhile (its engine may restart on it), beyond `keep`."""
    pub, ref = versions(6, model, tmp_path, full_every=3)  # 0 and 3 full, 1, 2, 4, 5 deltas
    host = tmp_path / "host"
    served = resolve_location(str(pub / "v00000001"), host, current=pub / "v00000000")
    assert served.parent == host
    got = resolve_location(str(pub / "v00000005"), host, keep=2, current=served)  # rebuilds 4 on 3, then 5
    assert same_bits(read_tensors(got), read_tensors(ref / "v00000005"))
    assert same_bits(read_tensors(served), read_tensors(ref / "v00000001"))


def test_a_host_in_step_writes_each_delta_over_a_version_it_prunes(tmp_path: Path, model: CausalLM) -> None:
    """keep=2: version n is written over the files of version n-2 (their pages are in the
    page cache), never over the one served, and holds exactly its own files and bits;
    deltas and full versions alike."""
    pub, ref = versions(5, model, tmp_path, full_every=8)
    host = tmp_path / "host"
    _, served = asyncio.run(receive_stream(feed(weight_chunks(pub / "v00000000", 0, full=True)), host))
    for version in (1, 2, 3):
        doomed = host / f"v{version - 2:08d}"
        if version == 3:  # a file the new version does not have, planted without making the directory newer
            made = doomed.stat()
            (doomed / "stale.bin").write_bytes(b"from an older version")
            os.utime(doomed, ns=(made.st_atime_ns, made.st_mtime_ns))
        inodes = {p.name: p.stat().st_ino for p in doomed.glob("*.safetensors")}
        messages = feed(weight_chunks(pub / f"v{version:08d}", version))
        _, served = asyncio.run(receive_stream(messages, host, base=served))
        assert same_bits(read_tensors(served), read_tensors(ref / f"v{version:08d}"))
        if version > 1:
            assert {p.name: p.stat().st_ino for p in served.glob("*.safetensors")} == inodes
    assert sorted(p.name for p in host.iterdir()) == ["v00000002", "v00000003"]
    assert sorted(p.name for p in served.iterdir()) == sorted(p.name for p in (host / "v00000002").iterdir())
    assert not (served / "stale.bin").exists()
    # A full version is written the same way: version 4, over version 2's files.
    inodes = {p.name: p.stat().st_ino for p in (host / "v00000002").glob("*.safetensors")}
    messages = feed(weight_chunks(ref / "v00000004", 4))
    _, served = asyncio.run(receive_stream(messages, host, base=served))
    assert same_bits(read_tensors(served), read_tensors(ref / "v00000004"))
    assert {p.name: p.stat().st_ino for p in served.glob("*.safetensors")} == inodes


async def feed(messages: Iterable[pb.WeightChunk]) -> AsyncIterator[pb.WeightChunk]:
    for message in messages:
        yield message


def test_streamed_delta_patches_the_served_version(published: Published, tmp_path: Path) -> None:
    deltas, fulls, _ = published
    host = tmp_path / "host"
    _, base = asyncio.run(receive_stream(feed(weight_chunks(deltas / "v00000003", 3, full=True)), host))
    messages = list(weight_chunks(deltas / "v00000004", 4, chunk_bytes=100))
    assert messages[0].header.delta and len(messages) > 2
    version, got = asyncio.run(receive_stream(feed(messages), host, base=base))
    assert version == 4 and same_bits(read_tensors(got), read_tensors(fulls / "v00000004"))

    with pytest.raises(WeightBaseMismatch, match="needs base version 3"):
        asyncio.run(receive_stream(feed(messages), tmp_path / "other", base=got))
    torn = messages[:-1]
    with pytest.raises(WeightTransferError, match="checksum|do not add up|too short"):
        asyncio.run(receive_stream(feed(torn), tmp_path / "torn", base=base))
    assert not [p for p in (tmp_path / "torn").iterdir() if p.name.startswith("v")]


def test_full_stream_with_a_wrong_digest_is_not_installed(published: Published, tmp_path: Path) -> None:
    deltas, _, _ = published
    messages = list(weight_chunks(deltas / "v00000003", 3, full=True))
    tensor = next(i for i, m in enumerate(messages) if m.WhichOneof("payload") == "tensor")
    data = bytearray(messages[tensor].tensor.data)
    data[0] ^= 1
    messages[tensor].tensor.data = bytes(data)
    with pytest.raises(WeightTransferError, match="digest"):
        asyncio.run(receive_stream(feed(messages), tmp_path / "host"))
    assert list((tmp_path / "host").iterdir()) == []
