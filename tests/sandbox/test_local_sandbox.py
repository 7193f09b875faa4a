"""The local sandbox: trial paths, limits, timeouts, copies and the Dockerfile replay."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from rollout_server.sandbox.base import AGENT_USER, SandboxError, SandboxSpec
from rollout_server.sandbox.local import LocalSandbox, _unprivileged_bwrap_works, bwrap_path, reap_local_dirs

from .test_network import serve

needs_bwrap = pytest.mark.skipif(bwrap_path() is None, reason="bubblewrap (bwrap) is not installed")
MakeBox = Callable[..., LocalSandbox]


@pytest.fixture
def make_box() -> Iterator[MakeBox]:
    made: list[LocalSandbox] = []

    def make(
        environment_dir: Path | None = None,
        use_bwrap: bool | None = True,
        network: str = "host",
        proxy_port: int | None = None,
        **limits: object,
    ) -> LocalSandbox:
        box = LocalSandbox(
            SandboxSpec(trial_id="local", environment_dir=environment_dir, **limits),  # type: ignore[arg-type]
            use_bwrap=use_bwrap,
            network=network,
            proxy_port=proxy_port,  # type: ignore[arg-type]
        )
        made.append(box)
        box.start()
        return box

    yield make
    for box in made:
        box.stop()


def task_env(root: Path) -> Path:
    (root / "app" / "pkg").mkdir(parents=True)
    (root / "app" / "pkg" / "mod.py").write_text("VALUE = 41\n")
    (root / "Dockerfile").write_text(
        "FROM legorl/base:bookworm\nWORKDIR /app\nCOPY --chown=agent:agent app/ /app/\nENV ANSWER=42\n"
        "RUN echo built > built.txt\n"
    )
    return root


def host_cmdlines() -> list[bytes]:
    cmdlines = []
    for proc in Path("/proc").iterdir():
        try:
            cmdlines.append((proc / "cmdline").read_bytes())
        except OSError:
            continue
    return cmdlines


def test_is_marked_unisolated(make_box: MakeBox) -> None:
    assert make_box().isolated is False


@needs_bwrap
def test_dockerfile_replay_and_trial_paths(make_box: MakeBox, tmp_path: Path) -> None:
    box = make_box(task_env(tmp_path / "env"))
    result = box.exec(
        "pwd; echo $ANSWER; cat built.txt; python3 -c 'import pkg.mod as m; print(m.VALUE + 1)'", timeout=30
    )
    assert result.stdout.split() == ["/app", "42", "built", "42"], result
    assert box.host_path("/app/built.txt").read_text() == "built\n"


@needs_bwrap
def test_host_system_is_read_only_and_processes_end_with_the_command(make_box: MakeBox) -> None:
    box = make_box()
    assert not box.exec("touch /usr/evil", timeout=10).ok
    assert box.exec("(sleep 300.4242 &) ; echo spawned", timeout=10).ok
    # Each command has its own pid namespace: the background sleep died with it (looked up from the host).
    assert not any(b"300.4242" in cmdline for cmdline in host_cmdlines())


@pytest.mark.parametrize("use_bwrap", [pytest.param(True, marks=needs_bwrap), False])
def test_timeout_and_exit_codes(make_box: MakeBox, use_bwrap: bool) -> None:
    box = make_box(use_bwrap=use_bwrap)
    result = box.exec("echo out; echo err >&2; exit 3", timeout=10)
    assert (result.exit_code, result.stdout, result.stderr, result.timed_out) == (3, "out\n", "err\n", False)
    slow = box.exec("sleep 30; echo never", timeout=0.5)
    assert slow.timed_out and slow.exit_code is None and "never" not in slow.stdout


@pytest.mark.parametrize("use_bwrap", [pytest.param(True, marks=needs_bwrap), False])
def test_memory_limit_is_enforced(make_box: MakeBox, use_bwrap: bool) -> None:
    box = make_box(use_bwrap=use_bwrap, memory_mb=200)
    result = box.exec(["python3", "-c", "x = bytearray(500 << 20)"], timeout=30)
    assert result.exit_code != 0 and "MemoryError" in result.stderr


def test_without_bwrap_commands_run_in_the_workdir_copy(make_box: MakeBox, tmp_path: Path) -> None:
    box = make_box(task_env(tmp_path / "env"), use_bwrap=False)
    result = box.exec("pwd; cat built.txt", timeout=10)
    assert result.stdout.split() == [str(box.host_path("/app")), "built"]


def test_copies_and_reserved_paths(make_box: MakeBox, tmp_path: Path) -> None:
    box = make_box(use_bwrap=False)
    src = tmp_path / "tests"
    src.mkdir()
    (src / "test.sh").write_text("echo hi\n")
    box.host_path("/tests").mkdir()
    (box.host_path("/tests") / "planted.sh").write_text("evil")
    box.copy_in(src, "/tests")
    assert sorted(os.listdir(box.host_path("/tests"))) == ["planted.sh", "test.sh"]  # merged, as `docker cp`
    box.copy_out("/tests", tmp_path / "back")
    assert (tmp_path / "back" / "test.sh").read_text() == "echo hi\n"
    with pytest.raises(SandboxError, match="not a trial path"):
        box.copy_in(src, "/usr/local/x")
    with pytest.raises(SandboxError, match="does not exist"):
        box.copy_out("/nothing", tmp_path / "y")


def test_stop_removes_everything_and_is_idempotent(make_box: MakeBox) -> None:
    box = make_box(use_bwrap=False)
    root = box.host_path("/app").parent.parent
    box.stop()
    box.stop()
    assert not root.exists()
    assert box.failure_reason() == "sandbox directory is gone"


def test_wall_clock_and_bad_dockerfile(make_box: MakeBox, tmp_path: Path) -> None:
    box = make_box(use_bwrap=False, wall_clock_s=0.2)
    os_sleep = box.exec("sleep 5", timeout=10)
    assert os_sleep.timed_out
    assert "wall-clock" in (box.failure_reason() or "")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "Dockerfile").write_text("FROM x\nCOPY ../outside /app/\n")
    with pytest.raises(SandboxError, match="not in the build context"):
        make_box(bad, use_bwrap=False)


# Prints one line per port on 127.0.0.1: OPEN <greeting> or FAIL <error>.
PROBE = """
import socket, sys
for port in sys.argv[1:]:
    try:
        with socket.create_connection(("127.0.0.1", int(port)), timeout=2) as s:
            print(port, "OPEN", s.recv(5).decode())
    except OSError as exc:
        print(port, "FAIL", type(exc).__name__)
"""


def probe(box: LocalSandbox, user: str, *ports: int) -> dict[int, str]:
    result = box.exec(["python3", "-c", PROBE, *map(str, ports)], timeout=30, user=user)
    assert result.ok, result
    return {int(line.split(" ", 1)[0]): line.split(" ", 1)[1] for line in result.stdout.splitlines()}


@needs_bwrap
@pytest.mark.parametrize("user", [AGENT_USER, "root"])
def test_proxy_only_reaches_the_proxy_and_not_the_engine(make_box: MakeBox, user: str) -> None:
    proxy, engine = serve(b"proxy", "127.0.0.1"), serve(b"engin", "127.0.0.1")
    box = make_box(network="proxy_only", proxy_port=proxy)
    assert box.network_isolated and box.proxy_host == "127.0.0.1"
    # Twice: every command gets its own namespace and its own forwarder.
    for _ in range(2):
        assert probe(box, user, proxy, engine) == {proxy: "OPEN proxy", engine: "FAIL ConnectionRefusedError"}


@needs_bwrap
def test_no_network_reaches_nothing(make_box: MakeBox) -> None:
    engine = serve(b"engin", "127.0.0.1")
    box = make_box(network="none")
    assert probe(box, AGENT_USER, engine) == {engine: "FAIL ConnectionRefusedError"}
    with pytest.raises(SandboxError, match="no network"):
        _ = box.proxy_host


def test_host_network_is_what_the_sandbox_shares_without_bwrap(make_box: MakeBox) -> None:
    engine = serve(b"engin", "127.0.0.1")
    box = make_box(use_bwrap=False, network="proxy_only", proxy_port=engine)
    assert not box.network_isolated
    assert probe(box, AGENT_USER, engine) == {engine: "OPEN engin"}


@pytest.mark.skipif(not _unprivileged_bwrap_works(), reason="needs root and bwrap that runs under a dropped uid")
def test_agent_commands_run_as_an_unprivileged_uid(make_box: MakeBox, tmp_path: Path) -> None:
    box = make_box(network="none")
    (tmp_path / "given.txt").write_text("x")
    box.copy_in(tmp_path / "given.txt", "/app/given.txt")  # files put in the agent's workdir are its own
    assert box.exec("echo y >> /app/given.txt", timeout=10, user=AGENT_USER).ok
    assert box.agent_uid is not None and box.agent_uid != make_box(network="none").agent_uid
    agent = box.exec(
        "id -u; touch /app/mine /tmp/mine /home/agent/mine /logs/agent/mine && echo wrote; "
        "touch /logs/verifier/reward.txt 2>/dev/null || echo refused",
        timeout=10,
        user=AGENT_USER,
    )
    assert agent.stdout.split() == [str(box.agent_uid), "wrote", "refused"], agent
    assert box.exec("id -u", timeout=10).stdout.strip() == "0"


@pytest.mark.skipif(os.geteuid() != 0, reason="the local sandbox's disk limit is a loop mount, which needs root")
@pytest.mark.parametrize("use_bwrap", [pytest.param(True, marks=needs_bwrap), False])
def test_storage_limit_fails_writes_past_it(make_box: MakeBox, use_bwrap: bool) -> None:
    box = make_box(use_bwrap=use_bwrap, storage_mb=20)
    big = box.exec("dd if=/dev/zero of=big bs=1M count=150 2>&1", timeout=60, user=AGENT_USER)
    assert "No space left on device" in big.stdout, big
    assert box.host_path("/app/big").stat().st_size <= 20 << 20
    # The trial goes on: once the agent frees space, writes work again.
    assert box.exec("rm big && echo ok > small && cat small", timeout=10, user=AGENT_USER).stdout == "ok\n"
    root = box.host_path("/app").parent.parent
    box.stop()
    assert not root.exists()


def test_the_final_message_replaces_what_the_agent_left_there(make_box: MakeBox, tmp_path: Path) -> None:
    """An in-process agent's last words go where the verifier reads them, written by root after the
    episode: a link the agent planted at that path is replaced, its target left alone."""
    from rollout_server.trial import FINAL_MESSAGE_PATH, _leave_final_message

    box = make_box(use_bwrap=False)
    target = tmp_path / "verifier-owned.txt"
    target.write_text("keep me\n")
    planted = box.host_path(FINAL_MESSAGE_PATH)
    planted.parent.mkdir(parents=True, exist_ok=True)
    planted.symlink_to(target)
    _leave_final_message(box, "the answer is 42")
    assert target.read_text() == "keep me\n"
    assert not planted.is_symlink() and planted.read_text() == "the answer is 42"


# A server that starts a sandbox with a disk limit (as root) and is then killed before it can stop it.
KILLED_SERVER = """
import sys, time
from rollout_server.sandbox.base import SandboxSpec
from rollout_server.sandbox.local import LocalSandbox
spec = SandboxSpec(trial_id="killed", environment_dir=None, storage_mb=int(sys.argv[1]) or None)
box = LocalSandbox(spec, use_bwrap=False, network="host")
box.start()
print(box.host_path("/app").parent.parent, flush=True)
time.sleep(600)
"""


def test_a_killed_servers_sandbox_is_reaped_and_a_live_ones_kept(make_box: MakeBox) -> None:
    storage_mb = 20 if os.geteuid() == 0 else 0  # the loop mount needs root
    server = subprocess.Popen([sys.executable, "-c", KILLED_SERVER, str(storage_mb)], stdout=subprocess.PIPE, text=True)
    assert server.stdout is not None
    printed = server.stdout.readline().strip()
    assert printed, "the server did not start its sandbox"
    orphan = Path(printed)
    server.kill()
    server.wait()
    live = make_box(use_bwrap=False).host_path("/app").parent.parent
    assert orphan.is_dir() and (orphan / "fs").is_dir()

    removed = reap_local_dirs(orphan.parent)
    assert orphan in removed and not orphan.exists()
    assert live.is_dir() and live not in removed
    assert not any(str(orphan) in line for line in Path("/proc/self/mounts").read_text().splitlines())
