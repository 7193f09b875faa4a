"""End to end over gRPC on the embedded engine: a rollout host (engine, proxy,
Docker sandboxes) runs groups of `lego` trials on a demo task and streams back
trajectories whose tokens and logprobs are the engine's."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from legorl_jax.fleet import Fleet, GroupSpec
from protos.legorl.v1 import rollout_pb2 as pb
from protos.legorl.v1 import rollout_pb2_grpc as pb_grpc
from rollout_server.server import RolloutServer

from .stack import lego, server_config

pytestmark = pytest.mark.docker


def test_groups_of_lego_trials_over_grpc(model_dir: Path) -> None:
    async def main() -> None:
        server = RolloutServer(server_config(), model_dir)
        address = await server.start()
        try:
            async with Fleet([address]) as fleet:
                specs = [
                    GroupSpec(
                        task=pb.TaskRef(task_id="edit-config"),
                        harness=lego(tools),
                        group_size=2,
                        sampling=pb.SamplingParams(temperature=1.0, top_p=1.0, top_k=-1, max_tokens=24, seed=1),
                        policy_version=0,
                    )
                    for tools in ("bash_only", "edit_tools")
                ]
                results = [r async for r in fleet.rollout(specs)]
                again = [r async for r in fleet.rollout(specs[:1])]
            channel = grpc.aio.insecure_channel(address)
            status = await pb_grpc.RolloutServiceStub(channel).GetStatus(pb.GetStatusRequest())
            await channel.close()
        finally:
            await server.stop(grace_s=30)
        assert status.capacity == 4 and status.engine_healthy and "lego" in status.harnesses
        assert status.in_flight_trials == 0
        assert len(results) == 2
        for result in results:
            assert len(result.trajectories) == 2
            for t in result.trajectories:
                assert t.status in (pb.TRIAL_STATUS_OK, pb.TRIAL_STATUS_CAP_EXCEEDED), t.error
                # a random model does not solve the task, and the verifier says so: graded 0, not ungraded
                assert t.HasField("reward") and t.reward == 0.0
                assert t.metrics.model_calls >= 1
                assert t.metrics.phase_times.agent_s > 0 and t.metrics.phase_times.verify_s > 0
                seq = t.sequences[0]
                assert len(seq.token_ids) == len(seq.loss_mask) == len(seq.behavior_logprobs)
                sampled = [lp for lp, m in zip(seq.behavior_logprobs, seq.loss_mask, strict=True) if m]
                assert sampled and all(lp <= 0.0 for lp in sampled)
                assert t.harness.config_id == result.spec.harness.config_id
        # Seeded (SamplingParams.seed): each trial samples from its own seed, so the same group asked
        # again samples the same episodes, trial for trial, and no two trials of a group share one.
        first = next(r for r in results if r.spec is specs[0])
        ids = [[list(s.token_ids) for s in t.sequences] for t in first.trajectories]
        assert ids == [[list(s.token_ids) for s in t.sequences] for t in again[0].trajectories]
        assert ids[0] != ids[1]

    asyncio.run(main())


def test_bad_requests_are_refused_with_clear_codes(model_dir: Path) -> None:
    async def main() -> None:
        server = RolloutServer(server_config(), model_dir)
        address = await server.start()
        try:
            async with grpc.aio.insecure_channel(address) as channel:
                stub = pb_grpc.RolloutServiceStub(channel)

                async def rollout(**fields) -> grpc.aio.AioRpcError:
                    request = pb.RolloutRequest(
                        tasks=[pb.TaskRef(task_id="edit-config")], harness_configs=[lego("bash_only")], group_size=1
                    )
                    for key, value in fields.items():
                        if isinstance(value, list):
                            del getattr(request, key)[:]
                            getattr(request, key).extend(value)
                        else:
                            setattr(request, key, value)
                    with pytest.raises(grpc.aio.AioRpcError) as info:
                        async for _ in stub.Rollout(request):
                            pass
                    return info.value

                err = await rollout(tasks=[pb.TaskRef(task_id="no-such-task")])
                assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "unknown task" in err.details()
                err = await rollout(harness_configs=[pb.HarnessConfig(name="nope")])
                assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "lego" in err.details()
                err = await rollout(harness_configs=[pb.HarnessConfig(name="lego", options_json='{"tools": 3}')])
                assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "tools" in err.details()
                err = await rollout(policy_version=9)
                assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
                err = await rollout(group_size=0)
                assert err.code() == grpc.StatusCode.INVALID_ARGUMENT

                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await stub.UpdateWeights(pb.UpdateWeightsRequest(version=1, location="/no/such/weights"))
                assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert (await stub.GetStatus(pb.GetStatusRequest())).loaded_policy_version == 0
        finally:
            await server.stop(grace_s=10)

    asyncio.run(main())


def test_streamed_weights_reach_the_engine(model_dir: Path, tmp_path: Path) -> None:
    """StreamWeights (fleets without shared storage): new weights load and the version moves."""
    from legorl_jax.models.demo_assets import build_tiny_hf_model
    from legorl_jax.train.weight_stream import WeightStreamer

    update = build_tiny_hf_model(tmp_path / "update", seed=1, tokenizer_dir=model_dir)

    async def main() -> None:
        server = RolloutServer(server_config(), model_dir)
        address = await server.start()
        try:
            engine = server.engine.client()
            prompt = list(range(5, 25))
            before = await engine.complete(prompt, max_tokens=4, temperature=1.0, logprobs=1)
            assert await WeightStreamer([address]).update_weights(7, str(update)) == {address: 7}
            after = await engine.complete(prompt, max_tokens=4, temperature=1.0, logprobs=1)
            await engine.aclose()
            async with grpc.aio.insecure_channel(address) as channel:
                status = await pb_grpc.RolloutServiceStub(channel).GetStatus(pb.GetStatusRequest())
        finally:
            await server.stop(grace_s=10)
        assert status.loaded_policy_version == 7
        # other weights, other distribution: the sampled tokens' logprobs move
        assert before[0].logprobs != after[0].logprobs

    asyncio.run(main())
