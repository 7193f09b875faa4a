"""The served-weights check (`legorl_jax.core.weight_probe`) end to end: the
learner's probe in `weights.json`, through every way a version reaches a host,
checked against what the engine computes after loading it."""

from __future__ import annotations

import asyncio
import json
import math
import shutil
from pathlib import Path

import grpc
import pytest

from legorl_jax.core.weight_layout import MANIFEST_FILE, Manifest, WeightTransferError, read_manifest
from legorl_jax.core.weight_probe import TOLERANCE, WeightProbe, compare, probe_token_ids, tolerance
from protos.legorl.v1 import rollout_pb2 as pb
from protos.legorl.v1 import rollout_pb2_grpc as pb_grpc

from .stack import running_server, scripted_server_config


def test_probe_ids_are_fixed_and_inside_every_vocabulary() -> None:
    assert probe_token_ids(151_936) == probe_token_ids(151_936) == probe_token_ids(5000)
    small = probe_token_ids(300)
    assert len(small) == 32 and max(small) < 300


def test_tolerance_is_the_least_precise_dtype_in_play() -> None:
    assert tolerance(["float32", "float32", "float32"]) == TOLERANCE["float32"]
    assert tolerance(["float32", "bfloat16", "float32"]) == TOLERANCE["bfloat16"]
    assert tolerance(["float32", None]) == TOLERANCE["bfloat16"]  # an engine's own default: not known to be f32


def test_compare_fails_a_short_or_non_finite_answer() -> None:
    probe = WeightProbe((1, 2, 3), (-1.0, -2.0), ("float32", "float32"))
    assert compare(probe, [None, -1.0005, -2.0], "float32").passed
    assert not compare(probe, [None, -1.5, -2.0], "float32").passed
    assert compare(probe, [None, -1.0], "float32").max_abs_diff == math.inf
    assert compare(probe, [None, float("nan"), -2.0], "float32").max_abs_diff == math.inf


def test_manifest_carries_the_probe_and_refuses_a_malformed_one(tmp_path: Path) -> None:
    probe = WeightProbe((5, 6, 7), (-0.5, -1.5), ("bfloat16", "float32"))
    manifest = Manifest(3, "abc", probe=probe)
    assert Manifest.parse(manifest.to_bytes(), "here") == manifest
    assert Manifest.parse(Manifest(3, "abc").to_bytes(), "here").probe is None
    bad = json.loads(manifest.to_bytes())
    bad["probe"]["logprobs"] = [-0.5]
    with pytest.raises(WeightTransferError, match="malformed"):
        Manifest.parse(json.dumps(bad).encode(), "here")


@pytest.fixture(scope="module")
def published(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Versions 1 (full) and 2 (a delta on 1) of another model than the served one, as the learner publishes."""
    from legorl_jax.models import from_hf
    from legorl_jax.models.demo_assets import build_tiny_hf_model
    from legorl_jax.train.publish import DirectoryPublisher

    root = tmp_path_factory.mktemp("published")
    other = build_tiny_hf_model(root / "other", seed=3, tokenizer_dir=model_dir)
    model = from_hf(other)
    publisher = DirectoryPublisher(root / "weights", tokenizer_from=model_dir, full_every=2)
    v1 = Path(publisher.publish(model, 1))
    # Sharper logits: a random model predicts near-uniformly, so versions would differ too little to tell.
    model.embed_tokens.embedding.value = model.embed_tokens.embedding.value * 8.0
    v2 = Path(publisher.publish(model, 2))
    return {"v1": v1, "v2": v2}


def test_a_delta_version_keeps_its_probe_when_a_host_rebuilds_it(published: dict[str, Path], tmp_path: Path) -> None:
    from rollout_server.weights import resolve_location

    v2 = read_manifest(published["v2"])
    assert v2 is not None and v2.base_version == 1 and v2.probe is not None
    rebuilt = resolve_location(str(published["v2"]), tmp_path, current=published["v1"])
    assert rebuilt != published["v2"] and read_manifest(rebuilt).probe == v2.probe  # type: ignore[union-attr]


def _update(address: str, version: int, location: Path) -> pb.UpdateWeightsResponse:
    async def call() -> pb.UpdateWeightsResponse:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = pb_grpc.RolloutServiceStub(channel)
            return await stub.UpdateWeights(pb.UpdateWeightsRequest(version=version, location=str(location)))

    return asyncio.run(call())


def test_a_host_serves_a_version_only_once_its_engine_passes_the_probe(
    model_dir: Path, published: dict[str, Path], tmp_path: Path
) -> None:
    """The embedded engine (float32) reloads each version and computes the learner's
    probe logprobs; a version whose weights are not what its probe says is refused,
    and the host keeps reporting the version it served before."""
    from legorl_jax.serve.server import EmbeddedEngine

    # Version 3 claims version 2's probe but holds version 1's weights: a reload that
    # loaded the wrong weights looks exactly like this to the host.
    liar = tmp_path / "v3"
    shutil.copytree(published["v1"], liar)
    v1, v2 = read_manifest(published["v1"]), read_manifest(published["v2"])
    assert v1 is not None and v2 is not None
    (liar / MANIFEST_FILE).write_bytes(Manifest(3, v1.digest, probe=v2.probe).to_bytes())

    async def main(url: str) -> tuple[list[pb.UpdateWeightsResponse], grpc.aio.AioRpcError, pb.ServerStatus]:
        async with running_server(scripted_server_config(url, **{"sandbox.kind": "local"}), model_dir) as server:
            async with grpc.aio.insecure_channel(server.address) as channel:
                stub = pb_grpc.RolloutServiceStub(channel)
                loaded = [
                    await stub.UpdateWeights(pb.UpdateWeightsRequest(version=v, location=str(published[f"v{v}"])))
                    for v in (1, 2)
                ]
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await stub.UpdateWeights(pb.UpdateWeightsRequest(version=3, location=str(liar)))
                status = await stub.GetStatus(pb.GetStatusRequest())
                return loaded, refused.value, status

    with EmbeddedEngine.start(model_dir, max_slots=4, max_len=512) as embedded:
        loaded, refused, status = asyncio.run(main(embedded.url))
    for reply in loaded:
        # float32 on both sides: far inside even float32's tolerance.
        assert reply.update_path == "reload" and 0 <= reply.probe_max_abs_diff < TOLERANCE["float32"] / 10
    assert refused.code() == grpc.StatusCode.INTERNAL and "does not serve those weights" in refused.details()
    assert status.loaded_policy_version == 2
