"""SIGTERM to a running `legorl rollout-server` process: it stops taking work,
lets its in-flight trials finish and stream out, and exits 0 with no trial
container left behind."""

from __future__ import annotations

import asyncio
import re
import signal
import sys
from pathlib import Path
from typing import Any

import docker
import grpc
import pytest

from protos.legorl.v1 import rollout_pb2 as pb
from protos.legorl.v1 import rollout_pb2_grpc as pb_grpc

from .stack import by_script, engine_on_host, rollout, rollout_request, task_variant, trial_containers, until

pytestmark = pytest.mark.docker

LEGORL = str(Path(sys.executable).with_name("legorl"))
_LISTENING = re.compile(r"rollout server on (\S+)")


async def start_server(engine_port: int, model_dir: Path, log: list[str]) -> tuple[asyncio.subprocess.Process, str]:
    settings = {
        "engine.kind": "external",
        "engine.url": f"http://127.0.0.1:{engine_port}",
        "sandbox.kind": "docker",
        "fleet.capacity_per_server": 4,
        "fleet.agent_timeout_s": 60,
        "fleet.verifier_timeout_s": 30,
        "tasks.demo": "false",
    }
    argv = [LEGORL, "rollout-server", "--model", str(model_dir), "--address", "127.0.0.1:0", "--drain-s", "60"]
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
            proc, address = await start_server(port, tokenizer_dir, log)
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

