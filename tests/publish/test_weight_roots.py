"""UpdateWeights with a local location is confined to the server's weight
roots, as task locations are: over the real service, a directory outside
them (given plainly, through `..`, through a symlink or as file://) is
INVALID_ARGUMENT naming the setting that allows it, and nothing is loaded;
the configured roots cover where the learner publishes."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import grpc
import pytest

from legorl_jax.core.config import load_config
from legorl_jax.models import CausalLM
from legorl_jax.train.publish import DirectoryPublisher
from protos.legorl.v1 import rollout_pb2 as pb
from protos.legorl.v1 import rollout_pb2_grpc as pb_grpc
from rollout_server.server import weights_roots
from rollout_server.weight_host import start


def test_local_locations_outside_the_roots_are_refused(tmp_path: Path, model: CausalLM) -> None:
    allowed = Path(DirectoryPublisher(tmp_path / "allowed", dtype="bfloat16").publish(model, 1))
    outside = tmp_path / "outside"
    shutil.copytree(allowed, outside / allowed.name)
    (tmp_path / "allowed" / "link").symlink_to(outside / allowed.name)
    escapes = [
        str(outside / allowed.name),
        f"{tmp_path}/allowed/../outside/{allowed.name}",
        str(tmp_path / "allowed" / "link"),
        f"file://{outside / allowed.name}",
    ]

    async def main() -> None:
        server, address, service = await start(tmp_path / "host", weights_roots=[tmp_path / "allowed"])
        try:
            async with grpc.aio.insecure_channel(address) as channel:
                stub = pb_grpc.RolloutServiceStub(channel)
                for location in escapes:
                    with pytest.raises(grpc.aio.AioRpcError) as refused:
                        await stub.UpdateWeights(pb.UpdateWeightsRequest(version=1, location=location))
                    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, location
                    assert "fleet.weights_location_roots" in (refused.value.details() or ""), location
                    assert service.host.policy_version == 0 and service.served_weights is None
                loaded = await stub.UpdateWeights(pb.UpdateWeightsRequest(version=1, location=str(allowed)))
                assert loaded.loaded_version == 1 and service.served_weights == allowed.resolve()
        finally:
            await server.stop(None)

    asyncio.run(main())


def test_the_roots_cover_where_the_learner_publishes(tmp_path: Path) -> None:
    local = load_config(None, [f"logging.run_dir={tmp_path / 'runs'}", f"fleet.weights_dir={tmp_path / 'shared'}"])
    assert weights_roots(local) == [tmp_path / "runs", tmp_path / "shared"]  # runs/<name>/weights is inside
    remote = load_config(None, ["fleet.weights_dir=gs://b/w", f"fleet.weights_location_roots=[{tmp_path / 'nfs'}]"])
    assert weights_roots(remote) == [tmp_path / "nfs", Path("runs")]
