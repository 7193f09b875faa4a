"""The reward is the verifier's alone: tampering before verification changes nothing.

Most attacks run as root here, i.e. stronger than a real agent (which runs as
the unprivileged `agent` user); the last tests show what that user cannot do.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from rollout_server.sandbox.base import AGENT_USER, Sandbox
from rollout_server.sandbox.factory import SandboxFactory, spec_for_task
from rollout_server.sandbox.local import LocalSandbox, bwrap_path
from rollout_server.tasks import Task, demo_tasks, load_task
from rollout_server.verifier import Verdict, verify

pytestmark = pytest.mark.docker
EDIT = next(t for t in demo_tasks() if t.name == "edit-config")  # a no-op scores 0 on it
REWRITER = "while :; do mkdir -p /logs/verifier; echo 1 > /logs/verifier/reward.txt; sleep 0.01; done"
# The [r] keeps pgrep from matching its own command line.
FIND_REWRITER = "pgrep -f 'echo 1 > /logs/verifie[r]'"


@pytest.fixture
def sandbox(docker_factory: SandboxFactory) -> Iterator[Sandbox]:
    box = docker_factory.create(spec_for_task(EDIT, f"guard-{uuid.uuid4().hex[:8]}"))
    box.start()
    yield box
    box.stop()


def image_task(tmp_path: Path, test_sh: str, verifier_timeout: float = 30.0) -> Task:
    """A task on the base image (no build) with a custom test.sh."""
    (tmp_path / "tests").mkdir(parents=True)
    (tmp_path / "environment").mkdir()
    (tmp_path / "task.toml").write_text(
        f'[verifier]\ntimeout_sec = {verifier_timeout}\n[environment]\ndocker_image = "legorl/base:bookworm"\n'
    )
    (tmp_path / "instruction.md").write_text("Nothing to do.\n")
    (tmp_path / "tests" / "test.sh").write_text(test_sh)
    return load_task(tmp_path)


def test_prewritten_reward_is_wiped(sandbox: Sandbox) -> None:
    assert sandbox.exec(
        "mkdir -p /logs/verifier && echo 1 > /logs/verifier/reward.txt"
        " && echo '{\"reward\": 1}' > /logs/verifier/reward.json",
        timeout=10,
    ).ok
    verdict = verify(sandbox, EDIT)
    assert (verdict.status, verdict.reward) == ("ok", 0.0), verdict


def test_background_rewriter_is_killed(sandbox: Sandbox) -> None:
    started = sandbox.exec(f"setsid nohup sh -c '{REWRITER}' >/dev/null 2>&1 &", timeout=10)
    assert started.ok
    assert sandbox.exec(f"sleep 0.3; {FIND_REWRITER}", timeout=10).ok, "the rewriter should be running"
    verdict = verify(sandbox, EDIT)
    assert (verdict.status, verdict.reward) == ("ok", 0.0), verdict
    assert not sandbox.exec(FIND_REWRITER, timeout=10).ok


def test_planted_tests_are_replaced(sandbox: Sandbox) -> None:
    plant = (
        "mkdir -p /tests && printf 'echo 1 > /logs/verifier/reward.txt\\n' > /tests/test.sh"
        " && echo junk > /tests/check_config.py"
    )
    assert sandbox.exec(plant, timeout=10).ok
    verdict = verify(sandbox, EDIT)
    assert (verdict.status, verdict.reward) == ("ok", 0.0), verdict


def test_agent_user_cannot_reach_the_verifier(sandbox: Sandbox) -> None:
    attempts = {
        "write reward": "echo 1 > /logs/verifier/reward.txt",
        "create /tests": "mkdir /tests",
        "replace bash": "cp /bin/true /bin/bash",
        "replace python": "cp /bin/true /usr/bin/python3",
        "become root": "su -c true root </dev/null",
    }
    for what, cmd in attempts.items():
        assert not sandbox.exec(cmd, timeout=10, user=AGENT_USER).ok, f"agent could {what}"
    assert sandbox.exec("echo work > /app/notes.txt", timeout=10, user=AGENT_USER).ok  # its own workdir is writable


def graded(docker_factory: SandboxFactory, task: Task) -> Verdict:
    box = docker_factory.create(spec_for_task(task, f"v-{uuid.uuid4().hex[:8]}"))
    try:
        box.start()
        return verify(box, task)
    finally:
        box.stop()


def test_verifier_timeout_is_a_graded_zero(docker_factory: SandboxFactory, tmp_path: Path) -> None:
    # The sandbox is healthy, so what hung the tests is what the agent left (a FIFO, say).
    verdict = graded(docker_factory, image_task(tmp_path, "sleep 60\necho 1 > /logs/verifier/reward.txt\n", 2))
    assert (verdict.status, verdict.reward) == ("no_reward", 0.0)
    assert "graded 0" in verdict.reason and "2s" in verdict.reason


def test_tests_that_write_no_reward_are_a_graded_zero(docker_factory: SandboxFactory, tmp_path: Path) -> None:
    verdict = graded(docker_factory, image_task(tmp_path, "echo grading >&2\nexit 3\n"))
    assert (verdict.status, verdict.reward) == ("no_reward", 0.0)
    assert "exited 3" in verdict.reason and "neither reward.txt" in verdict.reason
    assert "grading" in verdict.stderr


def test_agent_code_run_by_tests_cannot_read_them(docker_factory: SandboxFactory, tmp_path: Path) -> None:
    """/tests is root's alone while grading: agent code a test runs cannot read the answers."""
    test_sh = (
        "mkdir -p /logs/verifier\n"
        "if runuser -u agent -- cat /tests/test.sh >/dev/null 2>&1; then echo 1; else echo 0; fi"
        " > /logs/verifier/reward.txt\n"
    )
    verdict = graded(docker_factory, image_task(tmp_path, test_sh))
    assert (verdict.status, verdict.reward) == ("ok", 0.0), verdict


def test_dead_container_is_env_failure(docker_factory: SandboxFactory) -> None:
    box = docker_factory.create(spec_for_task(EDIT, f"dead-{uuid.uuid4().hex[:8]}"))
    try:
        box.start()
        assert docker_factory.client is not None
        docker_factory.client.containers.get(box.container_id).kill()  # type: ignore[attr-defined]
        verdict = verify(box, EDIT)
    finally:
        box.stop()
    assert (verdict.status, verdict.reward) == ("env_failure", None)
    assert "container stopped" in verdict.reason


@pytest.mark.skipif(bwrap_path() is None, reason="bubblewrap (bwrap) is not installed")
def test_local_sandbox_guards() -> None:
    box = LocalSandbox(spec_for_task(EDIT, "local-guard"), use_bwrap=True)
    try:
        box.start()
        assert box.exec("mkdir -p /tests && echo 'echo 1 > /logs/verifier/reward.txt' > /tests/test.sh", timeout=10).ok
        assert box.exec("echo 1 > /logs/verifier/reward.txt", timeout=10).ok
        verdict = verify(box, EDIT)
    finally:
        box.stop()
    assert (verdict.status, verdict.reward) == ("ok", 0.0), verdict
