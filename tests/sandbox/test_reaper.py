"""Orphan detection, and a killed owner's container removed by the next reap."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import docker
import pytest

from rollout_server.sandbox.owner import owner_id
from rollout_server.sandbox.reaper import DEADLINE_LABEL, OWNER_LABEL, orphan_reason, reap

NOW = 1_000_000.0


def labels(owner: str, deadline: float = NOW + 60) -> dict[str, str]:
    return {OWNER_LABEL: owner, DEADLINE_LABEL: str(deadline)}


def finished_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_live_owner_keeps_its_container() -> None:
    assert orphan_reason(labels(owner_id()), "running", NOW) is None


@pytest.mark.parametrize(
    ("container_labels", "status", "needle"),
    [
        (labels(owner_id(), deadline=NOW - 1), "running", "deadline passed"),
        (labels(owner_id()), "exited", "exited"),
        (labels(owner_id(finished_pid())), "running", "is gone"),
        # Same pid, different start time: the pid was recycled by an unrelated process.
        (labels(f"{socket.gethostname()}/{os.getpid()}/1"), "running", "is gone"),
        ({OWNER_LABEL: owner_id(), DEADLINE_LABEL: "soon"}, "running", "unreadable"),
    ],
)
def test_orphans_are_recognised(container_labels: dict[str, str], status: str, needle: str) -> None:
    assert needle in (orphan_reason(container_labels, status, NOW) or "")


def test_other_hosts_are_left_to_their_deadline() -> None:
    assert orphan_reason(labels("elsewhere/1/1"), "running", NOW) is None
    assert orphan_reason(labels("elsewhere/1/1", deadline=NOW - 1), "running", NOW) == "deadline passed"


# Starts a sandbox from a child process, prints its container id, then waits to be killed.
_OWNER_SCRIPT = """
import sys, time, docker
from rollout_server.sandbox.base import SandboxSpec
from rollout_server.sandbox.docker import DockerSandbox
from rollout_server.sandbox.images import BASE_IMAGE
spec = SandboxSpec(trial_id="orphan-test", environment_dir=None, docker_image=BASE_IMAGE)
box = DockerSandbox(spec, docker.from_env(), None)
box.start()
print(box.container_id, flush=True)
time.sleep(600)
"""


@pytest.mark.docker
def test_killed_owner_container_is_reaped(docker_client: docker.DockerClient) -> None:
    owner = subprocess.Popen([sys.executable, "-c", _OWNER_SCRIPT], stdout=subprocess.PIPE, text=True)
    try:
        assert owner.stdout is not None
        container_id = owner.stdout.readline().strip()
        assert container_id, "the owner process did not start a sandbox"
        assert "orphan-test" not in reap(docker_client)  # owner alive: kept
        assert docker_client.containers.get(container_id).status == "running"
    finally:
        owner.send_signal(signal.SIGKILL)
        owner.wait()
    assert "orphan-test" in reap(docker_client, now=time.time())
    with pytest.raises(docker.errors.NotFound):
        docker_client.containers.get(container_id)
