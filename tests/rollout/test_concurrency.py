"""32 trials at once on one host (the issue's bar for a 2-core machine): one
`Rollout` call, a group of 32 `lego` trials in their own Docker sandboxes,
each running the task's reference solution, all admitted together and all
graded 1."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import docker
import grpc
import pytest

from legorl_jax.demo.demonstrations import solution_command
from protos.legorl.v1 import rollout_pb2 as pb
from protos.legorl.v1 import rollout_pb2_grpc as pb_grpc
from rollout_server.tasks import load_task

from .stack import (
    by_script,
    engine_on_host,
    rollout_request,
    running_server,
    scripted_server_config,
    task_variant,
    trial_containers,
)

pytestmark = pytest.mark.docker

TRIALS = 32


def test_32_concurrent_trials_complete(
    tokenizer_dir: Path, tokenizer: Any, docker_client: docker.DockerClient, tmp_path: Path
) -> None:
    task = load_task(task_variant(tmp_path, "crowd"))

    async def main() -> tuple[list[pb.Trajectory], int]:
        with engine_on_host(tokenizer) as (engine, _, port):
            engine.respond = by_script({"crowd": solution_command(task)})
            config = scripted_server_config(
                f"http://127.0.0.1:{port}", **{"fleet.capacity_per_server": TRIALS, "fleet.agent_timeout_s": 300}
            )
            async with running_server(config, tokenizer_dir) as server:
                request = rollout_request("crowd", [task.root], group_size=TRIALS)
                async with grpc.aio.insecure_channel(server.address) as channel:
                    stub = pb_grpc.RolloutServiceStub(channel)
                    reader = asyncio.create_task(_collect(stub.Rollout(request)))
                    peak = 0
                    while not reader.done():
                        peak = max(peak, (await stub.GetStatus(pb.GetStatusRequest())).in_flight_trials)
                        await asyncio.sleep(0.2)
                    trajectories = await reader
        assert trial_containers(docker_client) == []
        return trajectories, peak

    trajectories, peak = asyncio.run(asyncio.wait_for(main(), 400))
    assert peak == TRIALS  # all admitted at once, none queued behind another
    assert len(trajectories) == TRIALS
    for t in trajectories:
        assert t.status == pb.TRIAL_STATUS_OK, t.error
        assert t.reward == 1.0


async def _collect(stream: Any) -> list[pb.Trajectory]:
    return [t async for t in stream]
