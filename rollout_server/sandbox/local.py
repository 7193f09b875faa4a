"""The local sandbox for machines without Docker: a temp dir, rlimits, bubblewrap.

Marked unisolated: the agent shares the host's network and user id. With
bubblewrap (`bwrap`) each command sees a private root: the host's /usr and /etc
read-only, and the trial's own directories (/app, /tests, /logs, ...) bound
from the temp dir, so Harbor tasks' absolute paths work unchanged; its own pid
namespace ends every process a command leaves behind. Without bubblewrap,
commands run in the temp dir's copy of the workdir on the host itself, which
only suits tasks written with relative paths.
"""

from __future__ import annotations

import os
import posixpath
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from rollout_server.sandbox import dockerfile
from rollout_server.sandbox.base import (
    AGENT_LOGS_DIR,
    ROOT_USER,
    VERIFIER_LOGS_DIR,
    ExecResult,
    SandboxError,
    SandboxSpec,
    as_argv,
)

# Host directories every command needs, shared read-only.
_SYSTEM_DIRS = ("usr", "etc", "bin", "sbin", "lib", "lib32", "lib64", "libx32", "opt")
_RESERVED = frozenset((*_SYSTEM_DIRS, "proc", "dev", "sys"))
_MAX_OUTPUT_CHARS = 1_000_000


def bwrap_path() -> str | None:
    return shutil.which("bwrap")


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
        prlimit, f"--as={memory}", f"--cpu={cpu_seconds}", f"--nproc={spec.pids_limit}", "--core=0", "--",
    ]


class LocalSandbox:
    def __init__(self, spec: SandboxSpec, use_bwrap: bool | None = None, share_network: bool = True) -> None:
        self.spec = spec
        self._bwrap = bwrap_path() if use_bwrap is None or use_bwrap else None
        if use_bwrap and self._bwrap is None:
            raise SandboxError("bubblewrap (bwrap) was requested but is not installed (apt-get install bubblewrap)")
        self._share_network = share_network
        self._root: Path | None = None
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
    def proxy_host(self) -> str:
        if not self._share_network:
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
        self._root = Path(tempfile.mkdtemp(prefix=f"legorl-{self.spec.trial_id}-"))
        self._deadline = time.monotonic() + self.spec.wall_clock_s
        for path in ("/tmp", AGENT_LOGS_DIR, VERIFIER_LOGS_DIR, "/home/agent", self._workdir):
            self.host_path(path).mkdir(parents=True, exist_ok=True)
        if self.spec.environment_dir is not None and (self.spec.environment_dir / "Dockerfile").is_file():
            try:
                self._replay(dockerfile.parse(self.spec.environment_dir / "Dockerfile"))
            except dockerfile.DockerfileError as exc:
                raise SandboxError(str(exc)) from exc

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
        if src.is_dir():
            shutil.copytree(src, target, symlinks=True, dirs_exist_ok=True)
        else:
            shutil.copy2(src, target)

    def _argv(self, cmd: list[str], workdir: str) -> tuple[list[str], str]:
        if self._bwrap is None:
            return cmd, str(self.host_path(workdir))
        argv = [self._bwrap, "--die-with-parent", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--new-session"]
        if not self._share_network:
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
        argv += ["--chdir", workdir, "--setenv", "HOME", "/home/agent", "--"]
        return argv + cmd, "/"

    def exec(
        self,
        cmd: str | list[str],
        *,
        timeout: float,
        env: dict[str, str] | None = None,
        workdir: str | None = None,
        user: str = ROOT_USER,
    ) -> ExecResult:
        """`user` is not switched: the local sandbox runs everything as the server's own user."""
        self._fs()  # raises unless started
        remaining = self._deadline - time.monotonic()
        if remaining <= 0:
            return ExecResult(None, "", f"wall-clock limit of {self.spec.wall_clock_s:.0f}s reached", timed_out=True)
        budget = min(timeout, remaining)
        command = as_argv(cmd)
        argv, cwd = self._argv(command, workdir or self._workdir)
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
        if self._root is not None:
            shutil.rmtree(self._root, ignore_errors=True)
