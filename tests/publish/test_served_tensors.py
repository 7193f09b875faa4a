"""The served version's tensors kept in host memory: a delta patched in memory
gives exactly a full publish's bits without reading the served files; a torn
or wrong-digest delta is refused over the real rollout service and the host
keeps serving the old version; a host that missed versions catches up."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import numpy as np
import pytest

from legorl_jax.core.weight_delta import encode_delta
from legorl_jax.core.weight_layout import DELTA_FILE, MANIFEST_FILE, Manifest, read_manifest, read_tensors
from legorl_jax.models import CausalLM
from legorl_jax.train.publish import DirectoryPublisher
from legorl_jax.train.weight_stream import WeightStreamer, weight_chunks
from protos.legorl.v1 import rollout_pb2 as pb
from protos.legorl.v1 import rollout_pb2_grpc as pb_grpc
from rollout_server.served_tensors import ServedTensors
from rollout_server.service import RolloutService
from rollout_server.weight_host import start
from rollout_server.weights import receive_stream
from tests.publish.test_weight_delta import Published, feed, nudged, published, same_bits
from tests.publish.test_weight_relay import served

__all__ = ["published"]  # the fixture, shared with test_weight_delta


def held_tensors(memory: ServedTensors, directory: Path) -> dict[str, np.ndarray]:
    manifest = read_manifest(directory)
    assert manifest is not None
    held = memory.take(directory, manifest.digest)
    assert held is not None, f"nothing held for {directory}"
    memory.hold(held)
    return held.tensors


def test_delta_patched_in_memory_equals_a_full_publish(published: Published, tmp_path: Path) -> None:
    deltas, fulls, _ = published
    memory = ServedTensors()
    host = tmp_path / "host"
    full = weight_chunks(deltas / "v00000003", 3, full=True)
    _, base = asyncio.run(receive_stream(feed(full), host, memory=memory))
    assert same_bits(held_tensors(memory, base), read_tensors(fulls / "v00000003"))
    # The served files gone: the delta can only have patched the tensors in memory.
    for file in base.glob("*.safetensors"):
        file.unlink()
    delta = weight_chunks(deltas / "v00000004", 4, chunk_bytes=100)
    version, got = asyncio.run(receive_stream(feed(delta), host, base=base, memory=memory))
    expected = read_tensors(fulls / "v00000004")
    assert version == 4 and same_bits(read_tensors(got), expected)
    assert same_bits(held_tensors(memory, got), expected)
    manifest, reference = read_manifest(got), read_manifest(fulls / "v00000004")
    assert manifest is not None and reference is not None
    assert (manifest.version, manifest.digest) == (4, reference.digest)


def wrong_digest_delta(pub: Path, out: Path) -> Path:
    """Version 1 as a delta whose blob is intact (its checksum holds) but whose
    promised result digest is not what patching gives: a sender's bug."""
    base_manifest = read_manifest(pub / "v00000000")
    assert base_manifest is not None
    blob = encode_delta(
        read_tensors(pub / "v00000000"),
        read_tensors(pub / "v00000001-full"),
        base_version=0,
        version=1,
        base_digest=base_manifest.digest,
        digest="0" * 64,
    )
    out.mkdir()
    (out / DELTA_FILE).write_bytes(blob)
    (out / MANIFEST_FILE).write_bytes(Manifest(1, "0" * 64, 0, base_manifest.digest).to_bytes())
    return out


def test_refused_deltas_leave_the_old_version_served(tmp_path: Path, model: CausalLM) -> None:
    pub = tmp_path / "pub"
    publisher = DirectoryPublisher(pub, keep=4, dtype="bfloat16", full_every=4)
    publisher.publish(model, 0)
    publisher.publish(nudged(model, 1), 1)
    DirectoryPublisher(tmp_path / "ref", dtype="bfloat16").publish(nudged(model, 1), 1)
    (tmp_path / "ref" / "v00000001").rename(pub / "v00000001-full")
    bad = wrong_digest_delta(pub, tmp_path / "bad")
    v0 = read_tensors(pub / "v00000000")
    v0_manifest = read_manifest(pub / "v00000000")
    assert v0_manifest is not None

    async def stream(address: str, directory: Path) -> pb.UpdateWeightsResponse:
        async with grpc.aio.insecure_channel(address) as channel:
            return await pb_grpc.RolloutServiceStub(channel).StreamWeights(feed(weight_chunks(directory, 1)))

    def serves_v0(service: RolloutService) -> None:
        assert service.host.policy_version == 0 and same_bits(served(service), v0)
        assert sorted(p.name for p in service.weights_root.iterdir()) == ["v00000000"]

    async def main() -> None:
        server, address, service = await start(tmp_path / "host")
        try:
            assert await WeightStreamer([address]).update_weights(0, str(pub / "v00000000")) == {address: 0}
            torn = list(weight_chunks(pub / "v00000001", 1, chunk_bytes=64))[:-1]
            async with grpc.aio.insecure_channel(address) as channel:
                with pytest.raises(grpc.aio.AioRpcError) as torn_error:
                    await pb_grpc.RolloutServiceStub(channel).StreamWeights(feed(torn))
            assert torn_error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            serves_v0(service)
            # A torn blob is refused before any element is written: memory still holds version 0's tensors.
            assert service.served_weights is not None
            assert same_bits(held_tensors(service.served_tensors, service.served_weights), v0)
            with pytest.raises(grpc.aio.AioRpcError, match="do not match its digest") as bad_error:
                await stream(address, bad)
            assert bad_error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            serves_v0(service)
            assert service.served_tensors.take(service.served_weights, v0_manifest.digest) is None
            # The patched copy was dropped; the good delta rebuilds from the served files.
            assert (await stream(address, pub / "v00000001")).loaded_version == 1
            assert same_bits(served(service), read_tensors(pub / "v00000001-full"))
        finally:
            await server.stop(None)

    asyncio.run(main())


def test_a_host_that_missed_versions_catches_up_in_memory(tmp_path: Path, model: CausalLM) -> None:
    models = [model, nudged(model, 1), nudged(nudged(model, 1), 2)]
    publisher = DirectoryPublisher(tmp_path / "pub", keep=3, dtype="bfloat16", full_every=4)
    reference = DirectoryPublisher(tmp_path / "ref", dtype="bfloat16")
    reference.publish(models[2], 2)

    async def main() -> None:
        server, address, service = await start(tmp_path / "host", weights_roots=[tmp_path / "pub"])
        try:
            location = publisher.publish(models[0], 0)
            assert await WeightStreamer([address]).update_weights(0, location) == {address: 0}
            publisher.publish(models[1], 1)  # never sent to the host
            location = publisher.publish(models[2], 2)
            # The served files gone: versions 1 and 2 can only be rebuilt from the tensors in memory.
            assert service.served_weights is not None
            for file in service.served_weights.glob("*.safetensors"):
                file.unlink()
            async with grpc.aio.insecure_channel(address) as channel:
                reply = await pb_grpc.RolloutServiceStub(channel).UpdateWeights(
                    pb.UpdateWeightsRequest(location=location, version=2)
                )
            assert reply.loaded_version == 2 and service.host.policy_version == 2
            expected = read_tensors(tmp_path / "ref" / "v00000002")
            assert same_bits(served(service), expected)
            assert service.served_weights is not None
            assert same_bits(held_tensors(service.served_tensors, service.served_weights), expected)
        finally:
            await server.stop(None)

    asyncio.run(main())
