"""The Docker sandbox: exec, copies, limits, labels and teardown, on a real container."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from pathlib import Path

import docker
import pytest

from rollout_server.sandbox.base import AGENT_USER, SandboxError, SandboxSpec
from rollout_server.sandbox.docker import DockerSandbox, _storage_size_support
from rollout_server.sandbox.images import BASE_IMAGE
from rollout_server.sandbox.owner import owner_id
from rollout_server.sandbox.reaper import DEADLINE_LABEL, OWNER_LABEL, TRIAL_LABEL

pytestmark = pytest.mark.docker
MakeBox = Callable[..., DockerSandbox]


def test_exec_returns_code_streams_env_workdir_and_user(make_box: MakeBox) -> None:
    box = make_box()
    result = box.exec(
        "echo out; echo err >&2; echo $GREETING; pwd; id -un; exit 7",
        timeout=10,
        env={"GREETING": "hi"},
        workdir="/tmp",
        user=AGENT_USER,
    )
    assert (result.exit_code, result.timed_out) == (7, False)
    assert result.stdout.split() == ["out", "hi", "/tmp", AGENT_USER]
    assert result.stderr == "err\n"
    assert box.exec(["pwd"], timeout=10).stdout.strip() == "/app"  # the image's WORKDIR by default


def test_exec_timeout_kills_the_command(make_box: MakeBox) -> None:
    box = make_box()
    result = box.exec("echo started; sleep 30; echo never", timeout=1)
    assert result.timed_out and not result.ok
    assert "never" not in result.stdout
    assert not box.exec("pgrep -f 'sleep 3[0]'", timeout=10).ok  # [0]: not this pgrep's own command line


def test_copy_in_merges_and_copy_out_round_trips(make_box: MakeBox, tmp_path: Path) -> None:
    box = make_box()
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "a.txt").write_text("alpha")
    (src / "sub" / "run.sh").write_text("echo ran")
    (src / "sub" / "run.sh").chmod(0o755)
    assert box.exec("mkdir -p /data/stale && touch /data/stale/old", timeout=10).ok
    box.copy_in(src, "/data")
    listing = box.exec("cd /data && find . -type f | sort && ./sub/run.sh", timeout=10)
    assert listing.stdout.split() == ["./a.txt", "./stale/old", "./sub/run.sh", "ran"]  # merged, as `docker cp`
    single = tmp_path / "one.txt"
    single.write_text("single file")
    box.copy_in(single, "/etc/new/dir/renamed.conf")  # missing parents are created
    assert box.exec(["cat", "/etc/new/dir/renamed.conf"], timeout=10).stdout == "single file"
    box.copy_out("/data", tmp_path / "back")
    assert (tmp_path / "back" / "a.txt").read_text() == "alpha"
    assert (tmp_path / "back" / "sub" / "run.sh").read_text() == "echo ran"
    box.copy_out("/etc/new/dir/renamed.conf", tmp_path / "back.conf")
    assert (tmp_path / "back.conf").read_text() == "single file"


def test_copy_in_replaces_a_link_the_agent_planted(make_box: MakeBox, tmp_path: Path) -> None:
    """Root copies into the agent's directories after an episode (its final message): a link planted
    there is replaced, its target left alone."""
    box = make_box()
    plant = "echo keep > /tmp/owned && ln -s /tmp/owned /logs/agent/final.txt"
    planted = box.exec(["sh", "-c", plant], timeout=30, user=AGENT_USER)
    assert planted.ok, planted.stderr
    message = tmp_path / "final.txt"
    message.write_text("the answer")
    box.copy_in(message, "/logs/agent/final.txt")
    assert box.exec(["cat", "/tmp/owned"], timeout=30).stdout == "keep\n"
    check = "test ! -L /logs/agent/final.txt && cat /logs/agent/final.txt"
    assert box.exec(["sh", "-c", check], timeout=30).stdout == "the answer"


def test_copy_errors_are_sandbox_errors(make_box: MakeBox, tmp_path: Path) -> None:
    box = make_box()
    with pytest.raises(SandboxError, match="does not exist"):
        box.copy_out("/no/such/path", tmp_path / "x")
    with pytest.raises(SandboxError, match="does not exist"):
        box.copy_in(tmp_path / "missing", "/x")


def test_limits_and_labels_are_applied(make_box: MakeBox, docker_client: docker.DockerClient) -> None:
    box = make_box(cpus=0.5, memory_mb=96, pids_limit=40)
    container = docker_client.containers.get(box.container_id)
    host = container.attrs["HostConfig"]
    assert (host["NanoCpus"], host["Memory"], host["MemorySwap"], host["PidsLimit"]) == (
        5 * 10**8,
        96 << 20,
        96 << 20,
        40,
    )
    assert host["NetworkMode"] == "none"
    assert container.labels[TRIAL_LABEL] == box.spec.trial_id
    assert container.labels[OWNER_LABEL] == owner_id()
    assert float(container.labels[DEADLINE_LABEL]) > time.time()
    forks = box.exec("for i in $(seq 80); do sleep 1 & done; wait", timeout=30, user=AGENT_USER)
    assert "Resource temporarily unavailable" in forks.stderr


def test_out_of_memory_is_counted(make_box: MakeBox) -> None:
    box = make_box(memory_mb=64)
    assert box.oom_kill_count() == 0
    hog = box.exec(["python3", "-c", "x = bytearray(400 << 20)"], timeout=30, user=AGENT_USER)
    assert hog.exit_code == 137
    assert box.oom_kill_count() == 1
    assert box.failure_reason() is None  # the container itself survives


def test_wall_clock_ends_the_container(make_box: MakeBox) -> None:
    box = make_box(wall_clock_s=1)
    for _ in range(50):
        if box.failure_reason() is not None:
            break
        time.sleep(0.2)
    assert "wall-clock limit" in (box.failure_reason() or "")
    with pytest.raises(SandboxError):
        box.exec("true", timeout=5)


def test_stop_is_idempotent_and_removes(make_box: MakeBox, docker_client: docker.DockerClient) -> None:
    box = make_box()
    container_id = box.container_id
    box.stop()
    box.stop()
    with pytest.raises(docker.errors.NotFound):
        docker_client.containers.get(container_id)
    assert box.failure_reason() == "container was removed during the trial"


def test_a_start_that_ends_after_its_stop_leaves_no_container(docker_client: docker.DockerClient) -> None:
    """A trial cancelled while its sandbox starts (in a worker thread) runs `stop` before the
    container exists: the start that finishes afterwards removes what it made."""
    trial = f"late-{uuid.uuid4().hex[:8]}"
    box = DockerSandbox(SandboxSpec(trial_id=trial, environment_dir=None, docker_image=BASE_IMAGE), docker_client, None)
    box.stop()
    with pytest.raises(SandboxError, match="stopped while it started"):
        box.start()
    assert docker_client.containers.list(all=True, filters={"label": f"{TRIAL_LABEL}={trial}"}) == []


def test_unstarted_and_networkless_sandbox_errors(docker_client: docker.DockerClient) -> None:
    box = DockerSandbox(
        SandboxSpec(trial_id="idle", environment_dir=None, docker_image=BASE_IMAGE), docker_client, None
    )
    with pytest.raises(SandboxError, match="not started"):
        box.exec("true", timeout=5)
    with pytest.raises(SandboxError, match="no network"):
        _ = box.proxy_host
    box.stop()  # nothing to stop: still fine
    missing = DockerSandbox(
        SandboxSpec(trial_id="m", environment_dir=None, docker_image="legorl/absent:1"), docker_client, None
    )
    with pytest.raises(SandboxError, match="no registry"):
        missing.start()


def test_orphans_are_reaped_and_kill_all_spares_the_container(make_box: MakeBox) -> None:
    box = make_box(pids_limit=64)
    # 100 orphans would exhaust 64 pids if PID 1 left them as zombies.
    spawn = box.exec(
        "for i in $(seq 100); do (sleep 0.01 &); done; sleep 0.5; ps -eo stat= | grep -c '^Z' || true",
        timeout=30,
        user=AGENT_USER,
    )
    assert spawn.stdout.strip() == "0", spawn
    assert box.exec("setsid sleep 300 > /dev/null 2>&1 &", timeout=10, user=AGENT_USER).ok
    box.kill_all_processes()
    assert box.failure_reason() is None
    assert not box.exec("pgrep -f 'sleep 30[0]'", timeout=10).ok


# Tries to write 150 MB as the agent, then says whether the disk filled up.
WRITE_150MB = "dd if=/dev/zero of=/app/big bs=1M count=150 2>&1; ls -s --block-size=1M /app/big"


def test_storage_limit_is_enforced_or_refused(make_box: MakeBox, docker_client: docker.DockerClient) -> None:
    if _storage_size_support(docker_client, BASE_IMAGE) is not None:
        # This daemon cannot cap a container's disk: the task is refused by name, never run unlimited.
        with pytest.raises(SandboxError, match=r"environment.storage_mb = 20, but this Docker daemon cannot"):
            make_box(storage_mb=20)
        return
    box = make_box(storage_mb=20)
    result = box.exec(WRITE_150MB, timeout=60, user=AGENT_USER)
    assert "No space left on device" in result.stdout, result
    assert int(result.stdout.split()[-2]) <= 20
    assert box.exec("rm /app/big && echo ok > /app/small && cat /app/small", timeout=10).stdout == "ok\n"


def test_unenforceable_storage_runs_unlimited_only_by_choice(
    docker_client: docker.DockerClient, caplog: pytest.LogCaptureFixture
) -> None:
    spec = SandboxSpec(
        trial_id=f"t-{uuid.uuid4().hex[:8]}", environment_dir=None, docker_image=BASE_IMAGE, storage_mb=20
    )
    box = DockerSandbox(spec, docker_client, None, unenforceable_storage="ignore")
    try:
        box.start()
        assert box.exec("echo ok", timeout=10).stdout == "ok\n"
    finally:
        box.stop()
    if _storage_size_support(docker_client, BASE_IMAGE) is not None:
        assert "WITHOUT a disk limit" in caplog.text


def test_an_exec_the_daemon_never_started_is_asked_again(make_box: MakeBox, monkeypatch: pytest.MonkeyPatch) -> None:
    """dockerd under load sometimes answers 126 without starting the process; that is retried, then an env error."""
    box = make_box()
    real = box._run_exec
    refusals = iter([(126, b"failed to start io pipe copy: unable to copy pipes: containerd-shim", None)])
    monkeypatch.setattr(box, "_run_exec", lambda *a: next(refusals, None) or real(*a))
    assert box.exec("echo ran", timeout=10).stdout == "ran\n"
    monkeypatch.setattr(box, "_run_exec", lambda *a: (126, b"OCI runtime exec failed: exec failed: unknown", None))
    with pytest.raises(SandboxError, match="Docker could not start a process"):
        box.exec("echo never", timeout=10)
    monkeypatch.setattr(box, "_run_exec", lambda *a: (126, b"", b"permission denied"))
    assert box.exec("./not-executable", timeout=10).exit_code == 126  # the command's own 126 is its answer
