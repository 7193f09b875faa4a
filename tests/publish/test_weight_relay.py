"""Weight sync over real rollout services (weights-only hosts): relay chains
deliver full and delta versions bit-exactly to every host; a host that missed
versions, a dead host in the chain and a sender dying mid-stream are handled
without any host serving torn or mixed weights."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from legorl_jax.core.weight_layout import read_tensors
from legorl_jax.models import CausalLM
from legorl_jax.train.publish import DirectoryPublisher
from legorl_jax.train.weight_stream import WeightStreamer, weight_chunks
from protos.legorl.v1 import rollout_pb2 as pb
from protos.legorl.v1 import rollout_pb2_grpc as pb_grpc
from rollout_server.service import RolloutService
from rollout_server.weight_host import MemoryEngine, start
from tests.publish.test_weight_delta import nudged, same_bits


def served(service: RolloutService) -> dict[str, np.ndarray]:
    engine = service.engine
    assert isinstance(engine, MemoryEngine)
    return engine.tensors


def test_relay_chain_delivers_full_and_delta_versions(tmp_path: Path, model: CausalLM) -> None:
    models = [model]
    for step in range(1, 4):
        models.append(nudged(models[-1], step))
    publisher = DirectoryPublisher(tmp_path / "pub", keep=2, dtype="bfloat16", full_every=4)
    reference = DirectoryPublisher(tmp_path / "ref", keep=4, dtype="bfloat16")

    async def main() -> None:
        hosts = [await start(tmp_path / f"host{i}") for i in range(4)]
        addresses = [address for _, address, _ in hosts]
        streamer = WeightStreamer(addresses, relay=True)
        direct: list[str] = []
        relayed = streamer._send

        async def recorded(address: str, *args: Any, **kwargs: Any) -> int:
            if not kwargs.get("relay_to"):
                direct.append(address)
            return await relayed(address, *args, **kwargs)

        streamer._send = recorded  # type: ignore[method-assign]

        async def sync(version: int, expect: list[int]) -> None:
            location = publisher.publish(models[version], version)
            reference.publish(models[version], version)
            assert await streamer.update_weights(version, location) == {addresses[i]: version for i in expect}
            expected = read_tensors(tmp_path / "ref" / f"v{version:08d}")
            for i in expect:
                assert hosts[i][2].host.policy_version == version and same_bits(served(hosts[i][2]), expected)

        async def restart_empty(i: int) -> None:
            server, address, _ = hosts[i]
            await server.stop(None)
            hosts[i] = await start(tmp_path / f"host{i}-new", address)

        try:
            await sync(0, [0, 1, 2, 3])
            await sync(1, [0, 1, 2, 3])
            assert direct == [] and publisher.last is not None and publisher.last.kind == "delta"
            # Host 1 restarts empty: it refuses the delta but passes the stream on; only it is caught up directly.
            await restart_empty(1)
            await sync(2, [0, 1, 2, 3])
            assert direct == [addresses[1]] * 4  # the delta (refused), then full version 0, deltas 1 and 2
            # Host 2 dies: the chain breaks there, host 3 gets the delta directly.
            direct.clear()
            await hosts[2][0].stop(None)
            await sync(3, [0, 1, 3])
            assert direct == [addresses[2], addresses[3]]
        finally:
            for server, _, _ in hosts:
                await server.stop(None)

    asyncio.run(main())


def test_sender_dying_mid_stream_installs_nothing_anywhere(tmp_path: Path, model: CausalLM) -> None:
    publisher = DirectoryPublisher(tmp_path / "pub", dtype="bfloat16", full_every=4)
    publisher.publish(model, 0)
    publisher.publish(nudged(model, 1), 1)

    async def main() -> None:
        hosts = [await start(tmp_path / f"host{i}") for i in range(3)]
        addresses = [address for _, address, _ in hosts]
        try:
            await WeightStreamer(addresses, relay=True).update_weights(0, str(tmp_path / "pub" / "v00000000"))
            messages = list(weight_chunks(tmp_path / "pub" / "v00000001", 1, chunk_bytes=64, relay_to=addresses[1:]))

            async def dies() -> AsyncIterator[pb.WeightChunk]:
                for message in messages[:-1]:
                    yield message
                raise RuntimeError("learner died")

            async with grpc.aio.insecure_channel(addresses[0]) as channel:
                # grpc cancels a call whose request iterator raises.
                with pytest.raises((grpc.aio.AioRpcError, asyncio.CancelledError)):
                    await pb_grpc.RolloutServiceStub(channel).StreamWeights(dies())
            await asyncio.sleep(0.5)  # the cancellation travels down the chain
            for _, _, service in hosts:
                assert service.host.policy_version == 0
                assert sorted(p.name for p in service.weights_root.iterdir()) == ["v00000000"]
        finally:
            for server, _, _ in hosts:
                await server.stop(None)

    asyncio.run(main())


def test_relay_chain_longer_than_the_bound_is_invalid(tmp_path: Path, model: CausalLM) -> None:
    publisher = DirectoryPublisher(tmp_path / "pub", dtype="bfloat16")
    location = Path(publisher.publish(model, 0))

    async def main() -> None:
        server, address, _ = await start(tmp_path / "host")
        try:
            chunks = weight_chunks(location, 0, relay_to=["127.0.0.1:1"] * 2000)

            async def feed() -> AsyncIterator[pb.WeightChunk]:
                for chunk in chunks:
                    yield chunk

            async with grpc.aio.insecure_channel(address) as channel:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await pb_grpc.RolloutServiceStub(channel).StreamWeights(feed())
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "relay_to" in (err.value.details() or "")
        finally:
            await server.stop(None)

    asyncio.run(main())


def test_a_refused_delta_reported_as_internal_still_catches_the_host_up(tmp_path: Path, model: CausalLM) -> None:
    """grpcio's asyncio client can report a server's early FAILED_PRECONDITION on a
    client stream as INTERNAL "Internal error from Core" (grpc/grpc#36066). The
    streamer must catch a host up by what it serves, not by the code: here the
    first delta send is made to fail that way, as seen in CI."""
    publisher = DirectoryPublisher(tmp_path / "pub", keep=2, dtype="bfloat16", full_every=4)
    publisher.publish(model, 0)
    location = publisher.publish(nudged(model, 1), 1)

    async def main() -> None:
        server, address, service = await start(tmp_path / "host")
        streamer = WeightStreamer([address])
        real_send = streamer._send
        sent: list[int] = []

        async def send(address: str, directory: Path, version: int, *args: Any, **kwargs: Any) -> int:
            sent.append(version)
            if len(sent) == 1:
                with pytest.raises(grpc.aio.AioRpcError):  # the host refuses: it serves no base
                    await real_send(address, directory, version, *args, **kwargs)
                raise grpc.aio.AioRpcError(
                    grpc.StatusCode.INTERNAL, grpc.aio.Metadata(), grpc.aio.Metadata(), "Internal error from Core"
                )
            return await real_send(address, directory, version, *args, **kwargs)

        streamer._send = send  # type: ignore[method-assign]
        try:
            assert await streamer.update_weights(1, location) == {address: 1}
            assert sent == [1, 0, 1] and service.host.policy_version == 1
        finally:
            await server.stop(None)

    asyncio.run(main())
