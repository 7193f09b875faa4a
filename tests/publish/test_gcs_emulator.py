"""Published weights on `gs://`, against a GCS emulator (gcp-storage-emulator, run by `gcs_emulator.py` on a
loopback port): the learner's DirectoryPublisher writes through tensorstore's gcs driver, and a rollout
server's UpdateWeights downloads through it, both with their default tensorstore context, pointed at the
emulator by the environment alone (`TENSORSTORE_GCS_HTTP_URL`; `GOOGLE_AUTH_TOKEN_FOR_TESTING` stands in for
credentials). Orbax checkpoints on `gs://` are `test_gcs_checkpoints.py`'s, with the same emulator.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
import tensorstore as ts
from flax import nnx

from legorl_jax.core.weight_layout import DELTA_FILE, MANIFEST_FILE
from legorl_jax.models import CausalLM
from legorl_jax.train.publish import DirectoryPublisher, PublishError
from protos.legorl.v1 import rollout_pb2 as pb
from protos.legorl.v1 import rollout_pb2_grpc as pb_grpc
from rollout_server.weight_host import start

from .emulated_gcs import BUCKET, FAST_FAILING, Emulator, point_at

pytestmark = pytest.mark.gcs

SMALL_SHARDS = 16 * 2**10  # several shard files for the tiny model


def keys(url: str) -> set[str]:
    return {k.decode() for k in ts.KvStore.open(url + "/").result().list().result()}


async def update_weights(stub: pb_grpc.RolloutServiceStub, version: int, location: str) -> pb.UpdateWeightsResponse:
    return await stub.UpdateWeights(pb.UpdateWeightsRequest(version=version, location=location))


def on_server(tmp_path: Path, steps: Callable[[pb_grpc.RolloutServiceStub, Any], Any]) -> None:
    """Runs `steps(stub, service)` against a started weights-only rollout server."""

    async def main() -> None:
        server, address, service = await start(tmp_path / "host")
        try:
            async with grpc.aio.insecure_channel(address) as channel:
                await steps(pb_grpc.RolloutServiceStub(channel), service)
        finally:
            await server.stop(None)

    asyncio.run(main())


def test_publish_download_serve_round_trip(
    tmp_path: Path, emulator: Emulator, model: CausalLM, hf_dir: Path, assert_loads_identical: Callable[..., None]
) -> None:
    url = f"gs://{BUCKET}/runs/demo/weights"
    publisher = DirectoryPublisher(url, keep=2, tokenizer_from=hf_dir, max_shard_bytes=SMALL_SHARDS, full_every=2)
    policies = {1: model, 2: CausalLM(model.config, rngs=nnx.Rngs(7)), 3: model}

    async def steps(stub: pb_grpc.RolloutServiceStub, service: Any) -> None:
        for version, policy in policies.items():
            location = publisher.publish(policy, version)
            assert location == publisher.latest() == f"{url}/v{version:08d}"
            assert (await update_weights(stub, version, location)).loaded_version == version
            assert_loads_identical(service.served_weights, policy)
            if version == 2:  # the bucket holds only the delta: the host patched version 1 with it
                assert keys(location) == {DELTA_FILE, MANIFEST_FILE}
        tokenizer = (service.served_weights / "tokenizer.json").read_bytes()
        assert tokenizer == (hf_dir / "tokenizer.json").read_bytes()
        # keep=2: version 1 was collected from the bucket, and is not served from the host's cache either.
        assert {k.split("/")[0] for k in keys(url)} == {"LATEST", "v00000002", "v00000003"}
        with pytest.raises(grpc.aio.AioRpcError) as gone:
            await update_weights(stub, 1, f"{url}/v00000001")
        assert gone.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert service.host.policy_version == 3

    on_server(tmp_path, steps)


def test_torn_upload_is_never_served(tmp_path: Path, emulator: Emulator, model: CausalLM) -> None:
    url = f"gs://{BUCKET}/torn"
    publisher = DirectoryPublisher(url, max_shard_bytes=SMALL_SHARDS)
    good = publisher.publish(model, 1)
    store: Any = publisher._store
    upload, calls = store.upload, []

    def dies_before_the_last_file(key: str, path: Path) -> None:
        calls.append(key)
        if path.name == MANIFEST_FILE:
            raise OSError("injected: the learner died before the last file")
        upload(key, path)

    store.upload = dies_before_the_last_file
    with pytest.raises(OSError, match="injected"):
        publisher.publish(model, 2)
    torn = f"{url}/v00000002"
    uploaded = {k.split("/", 1)[1] for k in keys(url) if k.startswith("v00000002/")}
    assert len(uploaded) == len(calls) - 1 > 3 and "config.json" in uploaded  # a loadable-looking directory
    assert publisher.latest() == good

    async def steps(stub: pb_grpc.RolloutServiceStub, service: Any) -> None:
        assert (await update_weights(stub, 1, good)).loaded_version == 1
        served = service.served_weights
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await update_weights(stub, 2, torn)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"no {MANIFEST_FILE} there; its upload did not finish" in (refused.value.details() or "")
        assert service.host.policy_version == 1 and service.served_weights == served

    on_server(tmp_path, steps)


def test_storage_gone_mid_publish(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, model: CausalLM) -> None:
    emu = Emulator(tmp_path / "bucket-data")  # on disk: what was uploaded outlives the restart
    emu.start()
    point_at(emu, monkeypatch)
    try:
        url = f"gs://{BUCKET}/gone"
        publisher = DirectoryPublisher(url, max_shard_bytes=SMALL_SHARDS, context=ts.Context(FAST_FAILING))
        good = publisher.publish(model, 1)
        store: Any = publisher._store
        upload, calls = store.upload, []

        def storage_dies_after_three_files(key: str, path: Path) -> None:
            calls.append(key)
            if len(calls) == 4:
                emu.stop()
            upload(key, path)

        store.upload = storage_dies_after_three_files
        started = time.monotonic()
        with pytest.raises(PublishError, match=rf"{url}: cannot write v00000002/\S+: .*connect"):
            publisher.publish(model, 2)
        assert time.monotonic() - started < 10
        emu.start()
        assert len({k for k in keys(url) if k.startswith("v00000002/")}) == 3
        assert publisher.latest() == good

        async def steps(stub: pb_grpc.RolloutServiceStub, service: Any) -> None:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await update_weights(stub, 2, f"{url}/v00000002")
            assert f"no {MANIFEST_FILE} there" in (refused.value.details() or "")
            assert service.host.policy_version == 0 and service.served_weights is None
            assert (await update_weights(stub, 1, good)).loaded_version == 1

        on_server(tmp_path, steps)
    finally:
        emu.stop()
