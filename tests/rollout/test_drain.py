"""SIGTERM to a running `legorl rollout-server` process: it stops taking work,
lets its in-flight trials finish and stream out, and exits 0 with no trial
container left behind; trials that outlast the grace are cancelled and
reported, so the grace bounds the shutdown."""

from __future__ import annotations

import asyncio
import re
import signal
import sys
import time
from pathlib import Path
from typing import Any

import docker
import grpc
import pytest

from protos.legorl.v1 import rollout_pb2 as pb
from protos.legorl.v1 import rollout_pb2_grpc as pb_grpc

from .stack import by_script, engine_on_host, lego, rollout, rollout_request, task_variant, trial_containers, until

pytestmark = pytest.mark.docker

LEGORL = str(Path(sys.executable).with_name("legorl"))
_LISTENING = re.compile(r"rollout server on (\S+)")


async def start_server(
    engine_port: int, model_dir: Path, log: list[str], task_root: Path, drain_s: float = 60, **overrides: object
) -> tuple[asyncio.subprocess.Process, str]:
    settings = {
        "engine.kind": "external",
        "engine.url": f"http://127.0.0.1:{engine_port}",
        "sandbox.kind": "docker",
        "fleet.capacity_per_server": 4,
        "fleet.agent_timeout_s": 60,
        "fleet.verifier_timeout_s": 30,
        "tasks.demo": "false",
        "tasks.location_roots": f"[{task_root}]",
        **overrides,
    }
    argv = [LEGORL, "rollout-server", "--model", str(model_dir), "--address", "127.0.0.1:0", "--drain-s", str(drain_s)]
    for key, value in settings.items():
        argv += ["--set", f"{key}={value}"]
    proc = await asyncio.create_subprocess_exec(*argv, stderr=asyncio.subprocess.PIPE)
    assert proc.stderr is not None
    while True:
        line = (await proc.stderr.readline()).decode()
        if not line:
            raise AssertionError("rollout-server exited before listening:\n" + "".join(log))
        log.append(line)
        if match := _LISTENING.search(line):
            # Keep reading, so a chatty server never blocks on a full pipe.
            asyncio.create_task(_drain_pipe(proc.stderr, log))
            return proc, match.group(1)


async def _drain_pipe(stream: asyncio.StreamReader, log: list[str]) -> None:
    while line := await stream.readline():
        log.append(line.decode())


def test_sigterm_lets_in_flight_trials_finish(
    tokenizer_dir: Path, tokenizer: Any, docker_client: docker.DockerClient, tmp_path: Path
) -> None:
    names = ["drain-a", "drain-b"]
    request = rollout_request("drain", [task_variant(tmp_path, name) for name in names])
    log: list[str] = []

    async def main() -> tuple[dict[str, pb.Trajectory], grpc.StatusCode, int, int]:
        with engine_on_host(tokenizer) as (engine, _, port):
            engine.respond = by_script({name: "sleep 3" for name in names})
            proc, address = await start_server(port, tokenizer_dir, log, tmp_path)
            try:
                reader = asyncio.create_task(rollout(address, request))
                await until(lambda: len(engine.log.replies) == len(names), "both agents to be in `sleep 3`")
                proc.send_signal(signal.SIGTERM)
                async with grpc.aio.insecure_channel(address) as channel:
                    stub = pb_grpc.RolloutServiceStub(channel)
                    while not (await stub.GetStatus(pb.GetStatusRequest())).draining:
                        await asyncio.sleep(0.05)
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await rollout(address, request)
                trajectories = await reader
                code = await proc.wait()
            finally:
                if proc.returncode is None:
                    proc.kill()
                    await proc.wait()
        return trajectories, refused.value.code(), code, proc.pid

    trajectories, refused, code, pid = asyncio.run(asyncio.wait_for(main(), 150))
    assert code == 0, "".join(log)
    assert refused == grpc.StatusCode.UNAVAILABLE
    assert sorted(trajectories) == names
    for t in trajectories.values():
        assert t.status == pb.TRIAL_STATUS_OK, t.error
        assert t.HasField("reward") and t.reward == 0.0
    assert trial_containers(docker_client, pid) == []


def test_sigterm_grace_is_bounded_when_trials_would_run_for_minutes(
    tokenizer_dir: Path, tokenizer: Any, docker_client: docker.DockerClient, tmp_path: Path
) -> None:
    """A 2 s grace, one agent in a 10-minute command, one waiting on a 10-minute model call: both are
    cancelled when the grace ends and stream out as CANCELLED, and the server exits soon after."""
    names = ["stuck-command", "stuck-model"]
    harness = lego(tool_timeout_s=900)
    request = rollout_request("stuck", [task_variant(tmp_path, name) for name in names], harness=harness)
    log: list[str] = []

    async def main() -> tuple[dict[str, pb.Trajectory], int, float, int]:
        with engine_on_host(tokenizer) as (engine, _, port):
            engine.respond = by_script({"stuck-command": "sleep 600", "stuck-model": "sleep 2"})
            proc, address = await start_server(
                port, tokenizer_dir, log, tmp_path, drain_s=2, **{"fleet.agent_timeout_s": 900}
            )
            try:
                reader = asyncio.create_task(rollout(address, request))
                await until(lambda: len(engine.log.replies) == len(names), "both agents to run their commands")
                # stuck-model's next model call (after its `sleep 2`) now waits ten minutes for the engine.
                engine.delay_s = 600
                await asyncio.sleep(4)
                proc.send_signal(signal.SIGTERM)
                signalled = time.monotonic()
                trajectories = await reader
                code = await proc.wait()
                took = time.monotonic() - signalled
            finally:
                if proc.returncode is None:
                    proc.kill()
                    await proc.wait()
        return trajectories, code, took, proc.pid

    trajectories, code, took, pid = asyncio.run(asyncio.wait_for(main(), 150))
    assert code == 0, "".join(log)
    # 2 s of grace, then cancellation, sandbox teardown and the bounded stops of gRPC and the proxy.
    assert took < 60, "".join(log)
    assert sorted(trajectories) == names
    for t in trajectories.values():
        assert t.status == pb.TRIAL_STATUS_CANCELLED, t.error
        assert "rollout server shut down" in t.error and not t.HasField("reward")
    assert trial_containers(docker_client, pid) == []
