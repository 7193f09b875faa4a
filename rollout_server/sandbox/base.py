"""The contract every sandbox honours: what a trial may ask of its environment.

Calls are synchronous (the docker SDK is); the asyncio server runs them with
`asyncio.to_thread`. Paths are always *sandbox* paths (`/app`, `/tests`,
`/logs/verifier`), so a task runs unchanged in Docker or in the local sandbox.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, runtime_checkable

# Harbor's fixed locations inside a trial's environment.
TESTS_DIR = "/tests"
SOLUTION_DIR = "/solution"
LOGS_DIR = "/logs"
AGENT_LOGS_DIR = "/logs/agent"
VERIFIER_LOGS_DIR = "/logs/verifier"

# The unprivileged account agents run as; the verifier runs as root.
AGENT_USER = "agent"
ROOT_USER = "root"


class SandboxError(RuntimeError):
    """The environment itself broke (image, container, copy): the trial is ungraded."""


@dataclass(frozen=True)
class ExecResult:
    exit_code: int | None
    stdout: str
    stderr: str
    timed_out: bool = False

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out

    def failure(self, limit_s: float) -> str:
        """Why a command that was not `ok` failed, for an error message: a time limit is not a crash."""
        if self.timed_out:
            return f"it ran past its {limit_s:.0f} s limit (an overloaded host?)"
        output = (self.stderr or self.stdout).strip()[-300:]
        return f"exit code {self.exit_code}" + (f": {output}" if output else "")


@dataclass(frozen=True)
class ToolMount:
    """A host file or directory shown read-only in the sandbox (a harness CLI and its runtime).
    There is no writable kind: nothing the agent does may reach back into the host."""

    source: Path  # absolute host path
    target: str  # absolute sandbox path


@dataclass(frozen=True)
class SandboxSpec:
    """What one trial's environment needs; built from a task plus server limits."""

    trial_id: str
    environment_dir: Path | None
    docker_image: str | None = None
    workdir: str | None = None  # None: the image's WORKDIR
    cpus: float = 1.0
    memory_mb: int = 2048
    storage_mb: int | None = None  # the writable filesystem's size; None: unlimited
    pids_limit: int = 512
    wall_clock_s: float = 3600.0
    build_timeout_s: float = 600.0
    env: dict[str, str] = field(default_factory=dict)
    tool_mounts: tuple[ToolMount, ...] = ()
    # Sandbox directories put ahead of the image's PATH, for every command: where the mounted tools live.
    path_prefix: tuple[str, ...] = ()


@runtime_checkable
class Sandbox(Protocol):
    """One trial's environment. stop() is idempotent and safe after any failure."""

    @property
    def isolated(self) -> bool:
        """True when the agent cannot reach the host, other trials or the network beyond the proxy."""
        ...

    @property
    def proxy_host(self) -> str:
        """Host name or IP under which the sandbox reaches the host's token-capture proxy."""
        ...

    def start(self) -> None: ...

    def exec(
        self,
        cmd: str | list[str],
        *,
        timeout: float,
        env: dict[str, str] | None = None,
        workdir: str | None = None,
        user: str = ROOT_USER,
    ) -> ExecResult: ...

    def copy_in(self, host_path: Path, sandbox_path: str) -> None:
        """Copy a host file or directory to sandbox_path (a directory merges into an existing one, as `docker cp`;
        a file or link at sandbox_path is replaced, never written through)."""
        ...

    def copy_out(self, sandbox_path: str, host_path: Path) -> None:
        """Copy a sandbox file or directory so that it becomes host_path."""
        ...

    def kill_all_processes(self) -> None:
        """End every process the agent may have left behind (before verification)."""
        ...

    def failure_reason(self) -> str | None:
        """Why the environment died under the trial (OOM, killed, gone), or None if it is healthy."""
        ...

    def oom_kill_count(self) -> int | None:
        """Processes killed for memory so far, or None where the sandbox cannot tell."""
        ...

    def stop(self) -> None: ...


def as_argv(cmd: str | list[str]) -> list[str]:
    """A string is a shell command line; a list is an argv."""
    return ["bash", "-c", cmd] if isinstance(cmd, str) else list(cmd)
