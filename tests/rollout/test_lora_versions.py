"""A LoRA run's adapter versions end to end on the embedded engine: the learner
publishes each version as its PEFT adapter alone, a real rollout server loads
it by location and by stream, the engine merges it onto its base, and the
served-weights probe (base + adapter, from the learner) passes; an adapter for
another base is refused before the engine sees it."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import grpc
import jax
import numpy as np
import pytest

from legorl_jax.core.config import EngineConfig
from legorl_jax.core.weight_layout import (
    ADAPTER_CONFIG_FILE,
    ADAPTER_WEIGHTS_FILE,
    MANIFEST_FILE,
    checkpoint_digest,
    read_manifest,
)
from legorl_jax.core.weight_probe import TOLERANCE
from legorl_jax.models import CausalLM, from_hf
from legorl_jax.models.lora import adapted, add_adapters
from protos.legorl.v1 import rollout_pb2 as pb
from protos.legorl.v1 import rollout_pb2_grpc as pb_grpc
from rollout_server.backends.client import EngineError
from rollout_server.backends.served_probe import probe_engine

from .stack import running_server, scripted_server_config, server_config

ADAPTER_FILES = sorted([ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE, MANIFEST_FILE])  # an adapter version, whole


def trained(model_dir: Path, seed: int) -> CausalLM:
    """The base with rank-4 adapters whose B is random: as if trained, so each version serves other weights."""
    model = from_hf(model_dir)
    add_adapters(model, rank=4, alpha=8.0, targets=["q_proj", "v_proj", "down_proj"], seed=seed)
    key = jax.random.key(seed)
    for _, module in adapted(model):
        assert module.lora_b is not None
        key, sub = jax.random.split(key)
        module.lora_b.set_value(0.5 * jax.random.normal(sub, module.lora_b.get_value().shape))
    return model


@pytest.fixture(scope="module")
def published(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Versions 1-3 as adapters on `model_dir`, and version 4 as an adapter on another base."""
    from legorl_jax.models.demo_assets import build_tiny_hf_model
    from legorl_jax.train.publish import DirectoryPublisher

    root = tmp_path_factory.mktemp("lora")
    publisher = DirectoryPublisher(root / "weights", keep=8, adapter_base=model_dir)
    out = {}
    for version in (1, 2, 3):
        out[f"v{version}"] = Path(publisher.publish(trained(model_dir, seed=version), version))
        assert publisher.last is not None and publisher.last.kind == "adapter"
        assert publisher.last.nbytes == sum(p.stat().st_size for p in out[f"v{version}"].iterdir())
    other = build_tiny_hf_model(root / "other", seed=3, tokenizer_dir=model_dir)
    stranger = DirectoryPublisher(root / "other-weights", adapter_base=other)
    out["v4"] = Path(stranger.publish(trained(other, seed=4), 4))
    return out


def test_an_adapter_version_is_the_adapter_and_names_its_base(model_dir: Path, published: dict[str, Path]) -> None:
    v1 = published["v1"]
    assert sorted(p.name for p in v1.iterdir()) == ADAPTER_FILES
    manifest = read_manifest(v1)
    assert manifest is not None and manifest.probe is not None
    assert manifest.adapter_base == checkpoint_digest(model_dir) and manifest.base_version is None
    assert json.loads((v1 / ADAPTER_CONFIG_FILE).read_text())["r"] == 4
    base_bytes = sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))
    assert (v1 / ADAPTER_WEIGHTS_FILE).stat().st_size < base_bytes / 4


def test_adapter_full_every_is_refused(model_dir: Path, tmp_path: Path) -> None:
    from legorl_jax.core.config import Config
    from legorl_jax.train.publish import DirectoryPublisher

    with pytest.raises(ValueError, match="full_every=2: adapter versions are never deltas"):
        DirectoryPublisher(tmp_path, adapter_base=model_dir, full_every=2)
    with pytest.raises(ValueError, match="fleet.weights_full_every=3 needs model.lora.publish: merged"):
        Config.model_validate({"model": {"lora": {}}, "fleet": {"weights_full_every": 3}})
    Config.model_validate({"model": {"lora": {"publish": "merged"}}, "fleet": {"weights_full_every": 3}})


def test_a_host_merges_each_adapter_onto_its_base(model_dir: Path, published: dict[str, Path]) -> None:
    """Versions 1 and 2 by location, 3 by stream: each passes the probe, so each was merged onto the
    base (a merge onto the previous merge would not compute the learner's logprobs); version 4's
    adapter, trained on another base, is refused and the host keeps serving 3."""
    from legorl_jax.serve.server import EmbeddedEngine
    from legorl_jax.train.weight_stream import WeightStreamer

    async def update(stub: pb_grpc.RolloutServiceStub, version: int) -> pb.UpdateWeightsResponse:
        location = str(published[f"v{version}"])
        return await stub.UpdateWeights(pb.UpdateWeightsRequest(version=version, location=location))

    async def main(url: str) -> tuple[list[pb.UpdateWeightsResponse], dict[str, float], grpc.aio.AioRpcError, int]:
        config = scripted_server_config(url, **{"sandbox.kind": "local"})
        async with running_server(config, model_dir) as server, grpc.aio.insecure_channel(server.address) as channel:
            stub = pb_grpc.RolloutServiceStub(channel)
            loaded = [await update(stub, 1), await update(stub, 2)]
            streamer = WeightStreamer([server.address])
            assert await streamer.update_weights(3, str(published["v3"])) == {server.address: 3}
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await update(stub, 4)
            status = await stub.GetStatus(pb.GetStatusRequest())
            return loaded, streamer.probe_diffs, refused.value, status.loaded_policy_version

    with EmbeddedEngine.start(model_dir, max_slots=4, max_len=512) as embedded:
        loaded, streamed, refused, serving = asyncio.run(main(embedded.url))
    diffs = [reply.probe_max_abs_diff for reply in loaded] + list(streamed.values())
    assert all(0 <= d < TOLERANCE["float32"] / 10 for d in diffs), diffs
    assert refused.code() == grpc.StatusCode.FAILED_PRECONDITION
    details = refused.details() or ""
    assert "applies to the base with digest" in details and "start it on the run's base" in details
    assert serving == 3


def test_versions_differ_enough_for_the_probe_to_tell(model_dir: Path, published: dict[str, Path]) -> None:
    """The probe check above means something: versions 1 and 2 are far apart on the probe."""
    p1, p2 = (read_manifest(published[v]).probe for v in ("v1", "v2"))  # type: ignore[union-attr]
    assert p1 is not None and p2 is not None
    assert np.max(np.abs(np.subtract(p1.logprobs, p2.logprobs))) > 100 * TOLERANCE["float32"]


def test_an_engine_restarted_on_an_adapter_version_serves_it_merged(
    model_dir: Path, published: dict[str, Path]
) -> None:
    """The host's own embedded engine (a supervised `legorl serve`), killed after loading an
    adapter version, comes back on the base with the adapter merged (`--lora-adapter`) and
    passes the version's probe again."""
    from rollout_server.backends.embedded import embedded_plan

    command = embedded_plan(EngineConfig(kind="embedded", port=8200), model_dir, weights_dir=published["v1"]).command
    assert command[command.index("--model") + 1] == str(model_dir)
    assert command[command.index("--lora-adapter") + 1] == str(published["v1"])

    async def main() -> float:
        config = server_config(**{"engine.kind": "embedded", "sandbox.kind": "local", "tasks.demo": "false"})
        async with running_server(config, model_dir) as server, grpc.aio.insecure_channel(server.address) as channel:
            stub = pb_grpc.RolloutServiceStub(channel)
            await stub.UpdateWeights(pb.UpdateWeightsRequest(version=1, location=str(published["v1"])))
            engine = server.engine
            assert engine is not None
            epoch = engine.epoch()
            engine.restart("a test kills it")
            async with engine.client() as client:
                await client.wait_for_restart(epoch, 180)  # the restart's own probe of version 1 passed
                result = await probe_engine(client, published["v1"], "float32")
            assert result is not None
            return result.max_abs_diff

    assert asyncio.run(main()) < TOLERANCE["float32"] / 10


def test_an_adapter_version_through_a_kvstore(model_dir: Path, tmp_path: Path) -> None:
    """Published to a tensorstore kvstore (memory://, as gs://), downloaded whole by the host."""
    import tensorstore as ts

    from legorl_jax.train.publish import DirectoryPublisher
    from rollout_server.weights import resolve_location

    context = ts.Context()
    publisher = DirectoryPublisher("memory://lora/weights", adapter_base=model_dir, context=context)
    location = publisher.publish(trained(model_dir, seed=1), 1)
    local = resolve_location(location, tmp_path / "cache", context=context)
    assert sorted(p.name for p in local.iterdir()) == ADAPTER_FILES
    manifest = read_manifest(local)
    assert manifest is not None and manifest.adapter_base == checkpoint_digest(model_dir)


class FakeEngine:
    """Records adapter loads and unloads; an unload of `gone` fails as after an engine restart."""

    def __init__(self, gone: str = "") -> None:
        self.calls: list[tuple[str, str]] = []
        self.gone = gone

    async def load_adapter(self, name: str, adapter_dir: str) -> str:
        self.calls.append(("load", name))
        return ""

    async def unload_adapter(self, name: str) -> str:
        self.calls.append(("unload", name))
        if name == self.gone:
            raise EngineError(404, f"the adapter {name} cannot be found")
        return ""


def test_an_adapter_is_unloaded_once_no_request_uses_it(tmp_path: Path) -> None:
    from typing import cast

    from rollout_server.backends.adapters import Adapter, AdapterRoute
    from rollout_server.backends.client import EngineClient

    async def main() -> list[tuple[str, str]]:
        fake = FakeEngine(gone="v2")
        engine = cast(EngineClient, fake)
        route = AdapterRoute()
        await route.serve(engine, await route.load(engine, 1, tmp_path))
        with route.use() as in_flight:  # a request through v1 outlives the switch to v2
            assert in_flight == Adapter("v1", 1)
            await route.serve(engine, await route.load(engine, 2, tmp_path))
            assert route.current == Adapter("v2", 2)
        await route.serve(engine, await route.load(engine, 3, tmp_path))  # v1 idle now; v2 gone with a restart
        await route.load(engine, 3, tmp_path)  # version 3 published again: unloaded, then loaded
        return fake.calls

    assert asyncio.run(main()) == [
        ("load", "v1"), ("load", "v2"), ("load", "v3"), ("unload", "v1"), ("unload", "v2"),
        ("unload", "v3"), ("load", "v3"),
    ]  # fmt: skip


def test_a_relay_chain_delivers_an_adapter_version(model_dir: Path, published: dict[str, Path], tmp_path: Path) -> None:
    """Streamed once, down a chain of three weights-only hosts on the run's base, plus one on
    another base, which refuses it while the hosts after it still get it."""
    from legorl_jax.core.weight_layout import read_tensors
    from legorl_jax.train.weight_stream import WeightStreamer
    from rollout_server.weight_host import MemoryEngine, start

    other = published["v4"].parent.parent / "other"  # the base version 4 was trained on

    async def main() -> tuple[dict[str, int], list[int]]:
        bases = [model_dir, other, model_dir, model_dir]
        hosts = [await start(tmp_path / f"host{i}", base=base) for i, base in enumerate(bases)]
        try:
            loaded = await WeightStreamer([address for _, address, _ in hosts], relay=True).update_weights(
                2, str(published["v2"])
            )
            engines = [service.engine for _, _, service in hosts]
            expected = read_tensors(published["v2"])

            def holds_v2(engine: object) -> bool:
                assert isinstance(engine, MemoryEngine)
                held = engine.tensors
                return held.keys() == expected.keys() and all(np.array_equal(held[k], v) for k, v in expected.items())

            same = [int(holds_v2(e)) for e in engines]
            return {address: loaded.get(address, -1) for _, address, _ in hosts}, same
        finally:
            for server, _, _ in hosts:
                await server.stop(None)

    loaded, same = asyncio.run(main())
    assert list(loaded.values()) == [2, -1, 2, 2] and same == [1, 0, 1, 1]
