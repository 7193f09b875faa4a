"""An UpdateWeights that lands while a trial's completion is in flight, end to
end over gRPC on the embedded engine: the Trajectory says which of that
completion's tokens each policy sampled, and the learner bounds staleness by
those per-token versions."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import numpy as np
import pytest
from serve.pause_after import frozen_after

from legorl_jax.fleet import GroupResult, GroupSpec
from legorl_jax.train.assemble import assemble
from protos.legorl.v1 import rollout_pb2 as pb
from protos.legorl.v1 import rollout_pb2_grpc as pb_grpc

from .stack import lego, rollout, rollout_request, running_server, scripted_server_config, task_variant, until

pytestmark = pytest.mark.docker

FROZEN_AT = 5  # tokens of the first completion sampled before the update lands


def test_an_update_mid_completion_reaches_the_learner_per_token(model_dir: Path, tmp_path: Path) -> None:
    from legorl_jax.models.demo_assets import build_tiny_hf_model
    from legorl_jax.serve.server import EmbeddedEngine

    update = build_tiny_hf_model(tmp_path / "update", seed=1, tokenizer_dir=model_dir)
    request = rollout_request("versions", [task_variant(tmp_path, "versions")], lego())
    # top_k 1: greedy, so the first completion runs past the pause point every time.
    request.sampling.CopyFrom(pb.SamplingParams(temperature=1.0, top_p=1.0, top_k=1, max_tokens=24))

    async def main(url: str, engine: object) -> pb.Trajectory:
        async with running_server(scripted_server_config(url), model_dir) as server:
            with frozen_after(engine, FROZEN_AT) as frozen:
                trials = asyncio.create_task(rollout(server.address, request))
                await until(frozen.is_set, "the first completion to reach its pause point")
                async with grpc.aio.insecure_channel(server.address) as channel:
                    stub = pb_grpc.RolloutServiceStub(channel)
                    loaded = await stub.UpdateWeights(pb.UpdateWeightsRequest(version=1, location=str(update)))
                assert loaded.loaded_version == 1
                return (await trials)["versions"]

    with EmbeddedEngine.start(model_dir, max_slots=4, max_len=4096) as embedded:
        trajectory = asyncio.run(main(embedded.url, embedded.served.engine))

    assert trajectory.status in (pb.TRIAL_STATUS_OK, pb.TRIAL_STATUS_CAP_EXCEEDED), trajectory.error
    first = trajectory.sequences[0]
    # The first completion's first tokens came from version 0, everything after from version 1.
    assert list(first.version_runs) == [0, 1] and first.version_run_lengths[0] == FROZEN_AT
    assert first.policy_version == 0 and first.unreported_version_tokens == 0
    assert all(list(s.version_runs) == [1] for s in trajectory.sequences[1:])

    # The learner at version 2 with a lag of 1 trains only the version-1 tokens.
    graded = pb.Trajectory()
    graded.CopyFrom(trajectory)
    graded.reward = 1.0 - trajectory.reward  # a group member with the other reward: contrast to train on
    spec = GroupSpec(pb.TaskRef(task_id="versions"), lego(), 2, request.sampling, policy_version=0)
    out = assemble([GroupResult(spec, "g", [trajectory, graded])], "grpo", min_policy_version=1)
    sampled = np.flatnonzero(first.loss_mask)
    train = out.sequences[0]
    assert not train.loss_mask[sampled[:FROZEN_AT]].any() and train.loss_mask[sampled[FROZEN_AT:]].all()
    assert train.token_versions is not None and set(train.token_versions[train.loss_mask]) == {1}
    assert out.metrics["rollout/stale_tokens_dropped"] == 2 * FROZEN_AT
    assert out.metrics["rollout/mixed_version_frac"] > 0 and out.metrics["rollout/version_span_max"] == 1
