"""After a failed engine reload the rollout host still protects every
directory its engine may be reading (the last one served and each one handed
over since) from the pruning of its weights root, over the real service,
until a later reload succeeds."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import grpc
import pytest

from legorl_jax.models import CausalLM
from legorl_jax.train.publish import DirectoryPublisher
from legorl_jax.train.weight_stream import weight_chunks
from protos.legorl.v1 import rollout_pb2 as pb
from protos.legorl.v1 import rollout_pb2_grpc as pb_grpc
from rollout_server.backends.client import EngineError
from rollout_server.weight_host import MemoryEngine, start
from tests.publish.test_weight_delta import feed, nudged


class FailingEngine(MemoryEngine):
    """Fails its reloads while `failing`, after reading part of the directory (as an engine that dies mid-load)."""

    failing = False

    async def update_weights(self, weights_path: str, mode: str = "keep", version: str | None = None) -> dict[str, Any]:
        if self.failing:
            self.loaded = Path(weights_path)
            raise EngineError(500, "reload failed half-way")
        return await super().update_weights(weights_path, mode, version)


def test_failed_reload_keeps_the_engine_directories(tmp_path: Path, model: CausalLM) -> None:
    publisher = DirectoryPublisher(tmp_path / "pub", keep=8, dtype="bfloat16")
    models = [model]
    for step in range(1, 5):
        models.append(nudged(models[-1], step))
    published = [Path(publisher.publish(m, version)) for version, m in enumerate(models)]
    root = tmp_path / "host"

    async def stream(address: str, version: int) -> pb.UpdateWeightsResponse:
        async with grpc.aio.insecure_channel(address) as channel:
            chunks = weight_chunks(published[version], version, full=True)
            return await pb_grpc.RolloutServiceStub(channel).StreamWeights(feed(chunks))

    def kept() -> list[str]:
        return sorted(p.name for p in root.iterdir())

    async def main() -> None:
        server, address, service = await start(root)
        engine = FailingEngine()
        service.engine = engine  # type: ignore[assignment]
        try:
            assert (await stream(address, 0)).loaded_version == 0
            engine.failing = True
            for version in (1, 2):
                with pytest.raises(grpc.aio.AioRpcError, match="reload failed half-way") as failed:
                    await stream(address, version)
                assert failed.value.code() == grpc.StatusCode.INTERNAL
            # Two reloads failed: the engine may hold version 0 still, or be reading 1 or 2. None is pruned
            # (keep is 2), though no delta may build on any of them.
            assert kept() == ["v00000000", "v00000001", "v00000002"]
            assert service.served_weights is None
            engine.failing = False
            assert (await stream(address, 3)).loaded_version == 3
            # Version 3 loaded: the older ones are free again, and keep-2 pruning goes on as before.
            assert (await stream(address, 4)).loaded_version == 4
            assert kept() == ["v00000003", "v00000004"]
        finally:
            await server.stop(None)

    asyncio.run(main())
