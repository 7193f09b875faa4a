"""Trials at once on one host: 32 `lego` trials in one `Rollout` call (the bar
for a 2-core machine), each in its own Docker sandbox running the task's
reference solution, all admitted together and all graded 1; and CLI trials,
each of which holds a thread while its CLI runs, all running at once up to the
host's capacity."""

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
    asking_mini,
    by_script,
    engine_on_host,
    rollout_request,
    running_server,
    scripted_server_config,
    stand_in_cli_task,
    task_variant,
    trial_containers,
    until,
)

pytestmark = pytest.mark.docker

TRIALS = 32
# More than the event loop's default thread pool holds on a 2-core machine (6).
CLI_TRIALS = 8
# TEST INSTRUMENT: a `mini` that asks the proxy once, then works for minutes, as a CLI mid-episode.
BUSY_MINI = asking_mini("ask()\ntime.sleep(600)\n")


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


def test_cli_trials_run_at_once_up_to_capacity(
    tokenizer_dir: Path, tokenizer: Any, docker_client: docker.DockerClient, tmp_path: Path
) -> None:
    """Every admitted CLI trial has its CLI running: the 8 stand-ins of a host of capacity 8 have
    all asked the engine while none has ended (on the loop's default pool, 6 did on 2 cores)."""
    task = stand_in_cli_task(tmp_path, "busy-cli", BUSY_MINI)

    async def main() -> None:
        with engine_on_host(tokenizer) as (engine, _, port):
            config = scripted_server_config(
                f"http://127.0.0.1:{port}", **{"fleet.capacity_per_server": CLI_TRIALS, "fleet.agent_timeout_s": 300}
            )
            async with running_server(config, tokenizer_dir) as server:
                request = rollout_request("busy", [task], pb.HarnessConfig(name="mini-swe-agent"), CLI_TRIALS)
                async with grpc.aio.insecure_channel(server.address) as channel:
                    call = pb_grpc.RolloutServiceStub(channel).Rollout(request)
                    reader = asyncio.create_task(_collect(call))
                    await until(lambda: len(engine.log.prompts) >= CLI_TRIALS, f"{CLI_TRIALS} CLIs to ask", 120)
                    assert not reader.done()  # none ended: they ran side by side
                    call.cancel()  # the client goes away; its sandboxes go with it
                    await until(lambda: trial_containers(docker_client) == [], "the sandboxes to go")

    asyncio.run(asyncio.wait_for(main(), 300))


async def _collect(stream: Any) -> list[pb.Trajectory]:
    return [t async for t in stream]
