"""The local sandbox for machines without Docker: a temp dir, rlimits, bubblewrap.

Marked unisolated: it reads the host's system files and shares its kernel
without a seccomp filter or cgroup limits. With bubblewrap (`bwrap`) each command sees a
private root: the host's /usr and /etc read-only, and the trial's own
directories (/app, /tests, /logs, ...) bound from the temp dir, so Harbor
tasks' absolute paths work unchanged; its own pid namespace ends every process
a command leaves behind. Its network namespace (unless `network="host"`) has
only loopback: the engine, the gRPC port and every other host service are out
of reach, and with `network="proxy_only"` the proxy's port on 127.0.0.1 is
forwarded to the host's proxy over a unix socket (proxy_forward.py). When the
server runs as root, agent commands run as an unprivileged uid of their own.

Without bubblewrap, commands run in the temp dir's copy of the workdir on the
host itself, as the server's user and on the host's network: nothing is
isolated, which only suits tasks written with relative paths.
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import posixpath
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Literal

from rollout_server.sandbox import dockerfile, proxy_forward
from rollout_server.sandbox.base import (
    AGENT_LOGS_DIR,
    ROOT_USER,
    VERIFIER_LOGS_DIR,
    ExecResult,
    SandboxError,
    SandboxSpec,
    as_argv,
)
from rollout_server.sandbox.owner import owner_alive, owner_id

# Host directories every command needs, shared read-only.
_SYSTEM_DIRS = ("usr", "etc", "bin", "sbin", "lib", "lib32", "lib64", "libx32", "opt")
_RESERVED = frozenset((*_SYSTEM_DIRS, "proc", "dev", "sys"))
_MAX_OUTPUT_CHARS = 1_000_000
# Where the proxy bridge (its unix socket and the forwarder script) appears in the sandbox.
_BRIDGE_DIR = "/run/legorl"
# Host uids for agent commands when the server is root: one per sandbox and far above ordinary
# accounts, so RLIMIT_NPROC counts one trial's processes only and trials cannot touch each other's files.
_AGENT_UID_BASE = 1_500_000
_AGENT_UID_SPAN = 100_000
_next_uid = itertools.count()
_SYSTEM_PATH = "/usr/local/bin:/usr/bin:/bin"

LocalNetwork = Literal["host", "proxy_only", "none"]
log = logging.getLogger(__name__)


def bwrap_path() -> str | None:
    return shutil.which("bwrap")


@functools.cache
def _unprivileged_bwrap_works() -> bool:
    """Whether bwrap runs under a dropped uid here (it needs unprivileged user namespaces)."""
    bwrap, setpriv = bwrap_path(), shutil.which("setpriv")
    if os.geteuid() != 0 or bwrap is None or setpriv is None:
        return False
    argv = [
        setpriv,
        f"--reuid={_AGENT_UID_BASE}",
        f"--regid={_AGENT_UID_BASE}",
        "--clear-groups",
        "--",
        bwrap,
        "--unshare-user",
        "--unshare-net",
        "--ro-bind",
        "/",
        "/",
        "true",
    ]
    works = subprocess.run(argv, capture_output=True, timeout=30).returncode == 0
    if not works:
        log.warning("bubblewrap cannot run as an unprivileged uid here: local-sandbox agents run as root")
    return works


class _ProxyBridge:
    """The host end of the proxy bridge: a unix socket whose connections go to the proxy's TCP port."""

    def __init__(self, path: Path, proxy_port: int) -> None:
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(str(path))
        path.chmod(0o666)  # connecting takes write permission, and agents run as their own uid
        self._listener.listen(64)
        threading.Thread(
            target=proxy_forward.serve,
            args=(self._listener, lambda: socket.create_connection(("127.0.0.1", proxy_port))),
            daemon=True,
        ).start()

    def close(self) -> None:
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept()
        except OSError:
            pass
        self._listener.close()


# In each sandbox's host directories: the owner id of the server that made them (`owner.py`).
_OWNER_FILE = ".owner"


def _claimed_dir(prefix: str) -> Path:
    """A new temp directory that names this process as its owner, for `reap_local_dirs`."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    (path / _OWNER_FILE).write_text(owner_id())
    return path


def reap_local_dirs(parent: Path | None = None) -> list[Path]:
    """Remove local sandboxes' directories whose server is gone (killed before `stop` ran), loop mounts
    (`storage_mb`) first; returns them. A directory without an owner file is not a sandbox's: left alone."""
    parent = Path(tempfile.gettempdir()) if parent is None else parent
    with open("/proc/self/mounts", encoding="utf-8") as fh:
        mounts = [line.split()[1] for line in fh]
    removed = []
    for path in sorted(parent.glob("legorl-*")):
        try:
            owner = (path / _OWNER_FILE).read_text()
        except OSError:
            continue
        if owner_alive(owner):
            continue
        for mount in mounts:
            if mount.startswith(f"{path}/"):
                subprocess.run(["umount", "-l", mount], capture_output=True, timeout=60)
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def _limits(spec: SandboxSpec) -> list[str]:
    """A `prlimit` prefix that sets the trial's resource limits on the command it runs.

    Not `preexec_fn`: that forces a real fork of this (gRPC- and JAX-threaded)
    process, and gRPC's fork handlers crash such children now and then.
    """
    memory = spec.memory_mb * 1024 * 1024
    cpu_seconds = int(spec.wall_clock_s * max(spec.cpus, 1.0)) + 1
    prlimit = shutil.which("prlimit")
    if prlimit is None:
        raise SandboxError("the local sandbox needs prlimit (util-linux) to set resource limits")
    return [
        prlimit,
        f"--as={memory}",
        f"--cpu={cpu_seconds}",
        f"--nproc={spec.pids_limit}",
        "--core=0",
        "--",
    ]


class LocalSandbox:
    """`network`: "host" shares the host's network; "none" and "proxy_only" give each command its own
    namespace (bubblewrap only), reaching nothing, or only the proxy at 127.0.0.1:`proxy_port`."""

    def __init__(
        self,
        spec: SandboxSpec,
        use_bwrap: bool | None = None,
        network: LocalNetwork = "host",
        proxy_port: int | None = None,
    ) -> None:
        self.spec = spec
        self._bwrap = bwrap_path() if use_bwrap is None or use_bwrap else None
        if use_bwrap and self._bwrap is None:
            raise SandboxError("bubblewrap (bwrap) was requested but is not installed (apt-get install bubblewrap)")
        if network == "proxy_only" and proxy_port is None:
            raise SandboxError("proxy_only networking needs the proxy's port")
        self._network = network
        self._proxy_port = proxy_port
        self._agent_uid: int | None = None
        if self._bwrap is not None and _unprivileged_bwrap_works():
            self._agent_uid = _AGENT_UID_BASE + next(_next_uid) % _AGENT_UID_SPAN
        self._bridge_dir: Path | None = None
        self._bridge: _ProxyBridge | None = None
        self._agent_dirs: tuple[Path, ...] = ()  # host paths owned by the agent uid, once handed over
        self._root: Path | None = None
        self._disk: Path | None = None  # the loop mount holding the trial's directories, with storage_mb
        self._workdir = spec.workdir or "/app"
        self._env: dict[str, str] = dict(spec.env)
        self._deadline = 0.0
        self._sessions: set[int] = set()

    @property
    def isolated(self) -> bool:
        return False

    @property
    def uses_bwrap(self) -> bool:
        return self._bwrap is not None

    @property
    def network_isolated(self) -> bool:
        """True when commands run in their own network namespace (bubblewrap), not the host's."""
        return self._bwrap is not None and self._network != "host"

    @property
    def agent_uid(self) -> int | None:
        """The host uid agent commands run as, or None when they run as the server's own user."""
        return self._agent_uid

    @property
    def proxy_host(self) -> str:
        if self._network == "none":
            raise SandboxError("this local sandbox has no network; it cannot reach a proxy")
        return "127.0.0.1"

    def _fs(self) -> Path:
        if self._root is None:
            raise SandboxError(f"sandbox {self.spec.trial_id} is not started")
        return self._root / "fs"

    def host_path(self, sandbox_path: str) -> Path:
        """Where a sandbox path lives on the host (only trial directories, never system ones)."""
        norm = posixpath.normpath(posixpath.join(self._workdir, sandbox_path))
        parts = [p for p in norm.split("/") if p]
        if not parts or parts[0] in _RESERVED:
            raise SandboxError(f"{sandbox_path} is not a trial path in the local sandbox")
        return self._fs().joinpath(*parts)

    def start(self) -> None:
        if self._root is not None:
            raise SandboxError(f"sandbox {self.spec.trial_id} already started")
        self._root = _claimed_dir(f"legorl-{self.spec.trial_id}-")
        self._deadline = time.monotonic() + self.spec.wall_clock_s
        if self.spec.storage_mb is not None:
            self._mount_disk(self.spec.storage_mb)
        for path in ("/tmp", AGENT_LOGS_DIR, VERIFIER_LOGS_DIR, "/home/agent", self._workdir):
            self.host_path(path).mkdir(parents=True, exist_ok=True)
        if self.network_isolated and self._network == "proxy_only":
            self._open_bridge()
        if self.spec.environment_dir is not None and (self.spec.environment_dir / "Dockerfile").is_file():
            try:
                self._replay(dockerfile.parse(self.spec.environment_dir / "Dockerfile"))
            except dockerfile.DockerfileError as exc:
                raise SandboxError(str(exc)) from exc
        if self._agent_uid is not None:
            self._hand_to_agent(self._agent_uid)

    def _mount_disk(self, size_mb: int) -> None:
        """The trial's directories on a filesystem of their own, `size_mb` large: writing past it fails
        with ENOSPC, as in a size-limited container. Needs root (a loop mount)."""
        assert self._root is not None
        fs = self._root / "fs"
        fs.mkdir()
        image = self._root / "disk.img"
        with image.open("wb") as fh:
            fh.truncate(size_mb << 20)
        for argv in (
            ["mkfs.ext4", "-q", "-F", "-m", "0", str(image)],
            ["mount", "-o", "loop,nosuid,nodev", str(image), str(fs)],
        ):
            try:
                proc = subprocess.run(argv, capture_output=True, text=True, timeout=60)
            except (OSError, subprocess.TimeoutExpired) as exc:
                raise SandboxError(
                    f"the task sets environment.storage_mb, which the local sandbox "
                    f"enforces with a loop mount: {argv[0]} failed: {exc}"
                ) from exc
            if proc.returncode != 0:
                raise SandboxError(
                    f"the task sets environment.storage_mb, which the local sandbox enforces "
                    f"with a loop mount (root only): {argv[0]} failed: {proc.stderr.strip()}"
                )
        self._disk = fs
        (fs / "lost+found").rmdir()

    def _open_bridge(self) -> None:
        # Its own short path: a unix socket's path is capped at 108 bytes.
        self._bridge_dir = _claimed_dir("legorl-px-")
        self._bridge_dir.chmod(0o711)
        shutil.copy(proxy_forward.__file__, self._bridge_dir / "proxy_forward.py")
        assert self._proxy_port is not None
        self._bridge = _ProxyBridge(self._bridge_dir / "proxy.sock", self._proxy_port)

    def _hand_to_agent(self, uid: int) -> None:
        """What the task image gives its agent account: the workdir, its home, its log dir, a shared /tmp."""
        assert self._root is not None
        for path in (self._root, self._fs()):
            path.chmod(0o711)  # the agent's bwrap resolves its bind sources through these
        self.host_path("/tmp").chmod(0o1777)
        self._agent_dirs = tuple(self.host_path(p) for p in (self._workdir, "/home/agent", AGENT_LOGS_DIR))
        for top in self._agent_dirs:
            self._chown_to_agent(top)

    def _chown_to_agent(self, top: Path) -> None:
        assert self._agent_uid is not None
        for path in (top, *top.rglob("*")):
            os.lchown(path, self._agent_uid, self._agent_uid)

    def _replay(self, steps: list[dockerfile.Step]) -> None:
        assert self.spec.environment_dir is not None
        context = self.spec.environment_dir.resolve()
        for step in steps:
            if step.instruction == "WORKDIR":
                self._workdir = posixpath.join(self._workdir, step.args[0])
                self.host_path(self._workdir).mkdir(parents=True, exist_ok=True)
            elif step.instruction == "ENV":
                self._env.update(dockerfile.env_pairs(step.args))
            elif step.instruction in ("COPY", "ADD"):
                *sources, dest = step.args
                for source in sources:
                    src = (context / source).resolve()
                    if not src.is_relative_to(context) or not src.exists():
                        raise SandboxError(f"Dockerfile line {step.line}: {source} is not in the build context")
                    target = dest if not dest.endswith("/") or src.is_dir() else posixpath.join(dest, src.name)
                    self._copy_into(src, target)
            else:
                result = self.exec(step.args[0], timeout=600)
                if not result.ok:
                    raise SandboxError(
                        f"Dockerfile line {step.line}: RUN failed ({result.exit_code}): {result.stderr[-2000:]}"
                    )

    def _copy_into(self, src: Path, sandbox_path: str) -> None:
        target = self.host_path(sandbox_path)
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.is_symlink():
            # Replaced, as Docker's copy replaces it: a link the agent planted must not take the write elsewhere.
            target.unlink()
        if src.is_dir():
            shutil.copytree(src, target, symlinks=True, dirs_exist_ok=True)
        else:
            shutil.copy2(src, target)
        if any(target.is_relative_to(top) for top in self._agent_dirs):
            # As the task images' `COPY --chown=agent`: what lands in the agent's directories is the agent's.
            self._chown_to_agent(target)

    def _argv(self, cmd: list[str], workdir: str, user: str) -> tuple[list[str], str]:
        if self._bwrap is None:
            return cmd, str(self.host_path(workdir))
        prefix: list[str] = []
        argv = [self._bwrap, "--die-with-parent", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--new-session"]
        if self._agent_uid is not None and user != ROOT_USER:
            setpriv = shutil.which("setpriv")
            assert setpriv is not None  # checked by _unprivileged_bwrap_works
            uid = str(self._agent_uid)
            prefix = [setpriv, f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--"]
            argv.append("--unshare-user")
        if self.network_isolated:
            argv.append("--unshare-net")
        for name in _SYSTEM_DIRS:
            host = Path("/") / name
            if host.is_symlink():
                argv += ["--symlink", os.readlink(host), f"/{name}"]
            elif host.is_dir():
                argv += ["--ro-bind", str(host), f"/{name}"]
        argv += ["--dev", "/dev", "--proc", "/proc"]
        for entry in sorted(self._fs().iterdir()):
            argv += ["--bind", str(entry), f"/{entry.name}"]
        if self._bridge_dir is not None:
            argv += ["--ro-bind", str(self._bridge_dir), _BRIDGE_DIR]
        argv += ["--chdir", workdir, "--setenv", "HOME", "/home/agent", "--"]
        if self._bridge is not None:
            python = shutil.which("python3", path=_SYSTEM_PATH)
            if python is None:
                raise SandboxError("the local sandbox's proxy bridge needs python3 in /usr/bin or /usr/local/bin")
            socket_path = f"{_BRIDGE_DIR}/proxy.sock"
            cmd = [python, "-I", f"{_BRIDGE_DIR}/proxy_forward.py", str(self._proxy_port), socket_path, "--", *cmd]
        return prefix + argv + cmd, "/"

    def exec(
        self,
        cmd: str | list[str],
        *,
        timeout: float,
        env: dict[str, str] | None = None,
        workdir: str | None = None,
        user: str = ROOT_USER,
    ) -> ExecResult:
        """`user` other than root runs as the sandbox's own uid when the server is root and
        bubblewrap works unprivileged; otherwise everything runs as the server's own user."""
        self._fs()  # raises unless started
        remaining = self._deadline - time.monotonic()
        if remaining <= 0:
            return ExecResult(None, "", f"wall-clock limit of {self.spec.wall_clock_s:.0f}s reached", timed_out=True)
        budget = min(timeout, remaining)
        command = as_argv(cmd)
        argv, cwd = self._argv(command, workdir or self._workdir, user)
        argv = _limits(self.spec) + argv
        full_env = {
            "PATH": "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin",
            "LANG": "C.UTF-8",
            **self._env,
            **(env or {}),
        }
        try:
            proc = subprocess.Popen(
                argv,
                cwd=cwd,
                env=full_env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
            )
        except OSError as exc:
            raise SandboxError(f"cannot run {command[0]} in trial {self.spec.trial_id}: {exc}") from exc
        self._sessions.add(proc.pid)
        try:
            stdout, stderr = proc.communicate(timeout=budget)
            timed_out = False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            stdout, stderr = proc.communicate()
            timed_out = True
        code = proc.returncode
        return ExecResult(
            None if timed_out else code,
            stdout.decode("utf-8", errors="replace")[-_MAX_OUTPUT_CHARS:],
            stderr.decode("utf-8", errors="replace")[-_MAX_OUTPUT_CHARS:],
            timed_out=timed_out,
        )

    def copy_in(self, host_path: Path, sandbox_path: str) -> None:
        host_path = Path(host_path)
        if not host_path.exists():
            raise SandboxError(f"copy_in: {host_path} does not exist")
        self._copy_into(host_path, sandbox_path)

    def copy_out(self, sandbox_path: str, host_path: Path) -> None:
        source = self.host_path(sandbox_path)
        if not source.exists():
            raise SandboxError(f"copy_out: {sandbox_path} does not exist in trial {self.spec.trial_id}")
        host_path = Path(host_path)
        host_path.parent.mkdir(parents=True, exist_ok=True)
        if source.is_dir():
            shutil.copytree(source, host_path, symlinks=True, dirs_exist_ok=True)
        else:
            shutil.copy2(source, host_path)

    def kill_all_processes(self) -> None:
        # Every exec leads its own session; leftovers that kept the session die with it.
        for session in self._sessions:
            try:
                os.killpg(session, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self._sessions.clear()

    def failure_reason(self) -> str | None:
        if self._root is None or not self._root.exists():
            return "sandbox directory is gone"
        if time.monotonic() >= self._deadline:
            return f"wall-clock limit of {self.spec.wall_clock_s:.0f}s reached"
        return None

    def oom_kill_count(self) -> int | None:
        # rlimits make allocations fail rather than kill, so there is nothing to count.
        return None

    def stop(self) -> None:
        self.kill_all_processes()
        if self._bridge is not None:
            self._bridge.close()
            self._bridge = None
        if self._bridge_dir is not None:
            shutil.rmtree(self._bridge_dir, ignore_errors=True)
        if self._disk is not None:
            # Lazily: a straggler still holding a file must not keep the trial's data on the host.
            subprocess.run(["umount", "-l", str(self._disk)], capture_output=True, timeout=60)
            self._disk = None
        if self._root is not None:
            shutil.rmtree(self._root, ignore_errors=True)
