"""Fault injection through the gRPC server: each fault ends its trial with the
right status and a reason, leaves no trial container behind, and never hangs
(every wait is bounded by asyncio.wait_for).

The agent is `lego` driven by the scripted engine, except for the harness
crash, the CLI killed for memory, the hung install check and the CLI that
retries past its cap, where the task image carries a stand-in for a CLI harness.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import docker
import grpc
import pytest

from protos.legorl.v1 import rollout_pb2 as pb
from protos.legorl.v1 import rollout_pb2_grpc as pb_grpc
from rollout_server import trial
from rollout_server.sandbox.reaper import TRIAL_LABEL

from .stack import (
    asking_mini,
    by_script,
    engine_on_host,
    kill_engine,
    prompted,
    rollout,
    rollout_request,
    running_server,
    scripted_server_config,
    stand_in_cli_task,
    task_variant,
    trial_containers,
    until,
)

pytestmark = pytest.mark.docker

BOUND_S = 120.0  # no scenario may take longer: a hang fails instead of stalling the suite

# TEST INSTRUMENT: stands in for mini-swe-agent's `mini` and dies the way a crashing CLI does.
CRASHING_MINI = """#!/bin/sh
[ "$1" = "--help" ] && { echo "Usage: mini [OPTIONS] (crashing stand-in)"; exit 0; }
echo "Traceback (most recent call last):" >&2
echo "RuntimeError: stand-in harness crashed on purpose" >&2
exit 1
"""

# TEST INSTRUMENT: a `mini` that outgrows its sandbox's memory and is killed for it (exit code 137).
OOMING_MINI = """#!/bin/sh
[ "$1" = "--help" ] && { echo "Usage: mini [OPTIONS] (memory-hungry stand-in)"; exit 0; }
exec python3 -c "b = bytearray(512 * 2**20)"
"""

# TEST INSTRUMENT: a `mini` whose install check (`mini --help`) never answers, as on an overloaded host.
HANGING_MINI = """#!/bin/sh
sleep 600
"""

# TEST INSTRUMENT: a `mini` that asks the proxy again whatever it answers, the cap's refusal included,
# as mini-swe-agent's litellm client does for minutes; only the trial can end it.
RETRYING_MINI = asking_mini("while True:\n    ask()\n    time.sleep(0.2)\n")


def containers_of(client: docker.DockerClient, request_id: str) -> list[Any]:
    # Listed low-level first: the high-level list inspects every trial container on the daemon and
    # fails on one that another trial removes in between.
    return [
        client.containers.get(c["Id"])
        for c in client.api.containers(filters={"label": TRIAL_LABEL})
        if (c.get("Labels") or {}).get(TRIAL_LABEL, "").startswith(f"{request_id}-")
    ]


def test_crash_kill_oom_a_hung_install_check_and_a_cli_retrying_past_its_cap_each_end_with_their_status(
    tokenizer_dir: Path, tokenizer: Any, docker_client: docker.DockerClient, tmp_path: Path, monkeypatch: Any
) -> None:
    commands = {"oom": 'python3 -c "b = bytearray(512 * 2**20)"; echo "exit $?"', "killed": "sleep 60"}
    oom, killed = task_variant(tmp_path, "oom", memory_mb=64), task_variant(tmp_path, "killed")
    mini = pb.HarnessConfig(name="mini-swe-agent")
    crash = rollout_request("crash", [stand_in_cli_task(tmp_path, "harness-crash", CRASHING_MINI)], mini)
    ooming = rollout_request("cli-oom", [stand_in_cli_task(tmp_path, "cli-oom", OOMING_MINI, memory_mb=64)], mini)
    hung = rollout_request("hung", [stand_in_cli_task(tmp_path, "install-hung", HANGING_MINI)], mini)
    retrying = rollout_request("retry", [stand_in_cli_task(tmp_path, "retries-past-cap", RETRYING_MINI)], mini)
    retrying.limits.max_model_calls, retrying.limits.agent_timeout_s = 2, 100.0
    monkeypatch.setattr(trial, "_INSTALL_CHECK_S", 3.0)
    monkeypatch.setattr(trial, "_CAP_GRACE_S", 1.0)

    async def main() -> dict[str, pb.Trajectory]:
        with engine_on_host(tokenizer) as (engine, _, port):
            engine.respond = by_script(commands)
            async with running_server(scripted_server_config(f"http://127.0.0.1:{port}"), tokenizer_dir) as server:
                requests = [
                    crash,
                    ooming,
                    hung,
                    retrying,
                    rollout_request("oom", [oom]),
                    rollout_request("kill", [killed]),
                ]
                calls = [asyncio.create_task(rollout(server.address, r)) for r in requests]
                await until(prompted(engine, "killed"), "the agent to be told to sleep")
                (victim,) = containers_of(docker_client, "kill")
                victim.kill()
                results = {k: v for call in calls for k, v in (await call).items()}
            assert trial_containers(docker_client) == []
            return results

    results = asyncio.run(asyncio.wait_for(main(), BOUND_S))
    crashed = results["harness-crash"]
    assert crashed.status == pb.TRIAL_STATUS_HARNESS_ERROR, crashed.error
    assert "exit code 1" in crashed.error and "crashed on purpose" in crashed.error
    assert not crashed.HasField("reward")
    # A CLI killed by the memory limit says only "137": the reason adds the cause. It stays ungraded, as
    # the harness itself may be what outgrew the sandbox.
    cli_oom = results["cli-oom"]
    assert cli_oom.status == pb.TRIAL_STATUS_HARNESS_ERROR, cli_oom.error
    assert "exit code 137" in cli_oom.error and "out of memory" in cli_oom.error and "64 MB" in cli_oom.error
    assert not cli_oom.HasField("reward")
    # A check that hangs is the host's trouble, and its error says so rather than "not installed".
    hung_trial = results["install-hung"]
    assert hung_trial.status == pb.TRIAL_STATUS_ENV_FAILURE, hung_trial.error
    assert "ran past its 3 s limit" in hung_trial.error and "bake it into" not in hung_trial.error
    assert not hung_trial.HasField("reward")
    oom_trial = results["oom"]
    assert oom_trial.status == pb.TRIAL_STATUS_CAP_EXCEEDED, oom_trial.error
    assert "out of memory" in oom_trial.error and "64 MB" in oom_trial.error
    assert oom_trial.HasField("reward") and oom_trial.reward == 0.0  # a cap still leaves the trial graded
    # The CLI would have asked until its 100 s ran out; a second after the refusal the trial ended it.
    capped = results["retries-past-cap"]
    assert capped.status == pb.TRIAL_STATUS_CAP_EXCEEDED, capped.error
    assert "max_model_calls (2)" in capped.error and capped.metrics.model_calls == 2
    assert capped.HasField("reward") and capped.metrics.phase_times.agent_s < 60
    killed_trial = results["killed"]
    assert killed_trial.status == pb.TRIAL_STATUS_ENV_FAILURE, killed_trial.error
    assert "container" in killed_trial.error and not killed_trial.HasField("reward")


def test_engine_dying_under_a_waiting_trial_is_an_engine_error(
    tokenizer_dir: Path, tokenizer: Any, docker_client: docker.DockerClient, tmp_path: Path
) -> None:
    task = task_variant(tmp_path, "engine-down")

    async def main() -> pb.Trajectory:
        with engine_on_host(tokenizer) as (engine, thread, port):
            engine.respond = by_script({"engine-down": "sleep 1"})
            async with running_server(scripted_server_config(f"http://127.0.0.1:{port}"), tokenizer_dir) as server:
                state = thread.server.server_state
                answered = state.total_requests  # counts responses sent: so far the start-up's probes
                call = asyncio.create_task(rollout(server.address, rollout_request("down", [task])))
                await until(prompted(engine, "engine-down"), "the first reply")
                engine.delay_s = 300.0  # the agent's next model call will sit in the engine...
                await until(lambda: state.total_requests > answered, "the first reply to be sent")
                await until(lambda: len(state.tasks) > 0, "the agent's next model call")
                await asyncio.to_thread(kill_engine, thread)  # ...when the engine dies under it
                (trial,) = (await call).values()
            assert trial_containers(docker_client) == []
            return trial

    trial = asyncio.run(asyncio.wait_for(main(), BOUND_S))
    assert trial.status == pb.TRIAL_STATUS_ENGINE_ERROR, trial.error
    assert "engine" in trial.error and not trial.HasField("reward")
    assert trial.metrics.model_calls == 1  # the answered call is still captured


def test_client_going_away_tears_its_sandboxes_down(
    tokenizer_dir: Path, tokenizer: Any, docker_client: docker.DockerClient, tmp_path: Path
) -> None:
    names = ["gone-a", "gone-b"]
    tasks = [task_variant(tmp_path, name) for name in names]

    async def main() -> pb.ServerStatus:
        with engine_on_host(tokenizer) as (engine, _, port):
            engine.respond = by_script({name: "sleep 60" for name in names})
            async with running_server(scripted_server_config(f"http://127.0.0.1:{port}"), tokenizer_dir) as server:
                async with grpc.aio.insecure_channel(server.address) as channel:
                    stub = pb_grpc.RolloutServiceStub(channel)
                    call = stub.Rollout(rollout_request("gone", tasks))
                    reader = asyncio.create_task(anext(aiter(call), None))
                    for name in names:
                        await until(prompted(engine, name), f"trial {name} to be sleeping")
                    call.cancel()
                    with pytest.raises(asyncio.CancelledError):
                        await reader
                    await until(lambda: trial_containers(docker_client) == [], "the sandboxes to go")
                    await until(lambda: server.service._running == 0, "the trials to end")
                    return await stub.GetStatus(pb.GetStatusRequest())

    status = asyncio.run(asyncio.wait_for(main(), BOUND_S))
    assert (status.in_flight_trials, status.queued_trials) == (0, 0)
