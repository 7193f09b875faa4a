"""One Docker container per trial, driven through the docker SDK.

The container's PID 1 is a small shell loop (the keeper) that lives for the
trial's wall-clock budget: when it runs out the container stops by itself, even
if the process that made it is gone, and the reaper removes what is left (see
reaper.py). Being PID 1 it also reaps orphaned zombies (which would otherwise
eat the pids limit) and survives `kill -9 -1` from inside, which is how every
other process is ended before verification.
"""

from __future__ import annotations

import io
import logging
import posixpath
import shutil
import tarfile
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Literal

import docker
import docker.errors
from docker.models.containers import Container
from docker.types import Mount

from rollout_server.sandbox import reaper
from rollout_server.sandbox.base import ROOT_USER, ExecResult, SandboxError, SandboxSpec, ToolMount, as_argv
from rollout_server.sandbox.images import ensure_task_image
from rollout_server.sandbox.network import ProxyNetwork

log = logging.getLogger(__name__)

# `wait` in sh reaps any child, including orphans re-parented to PID 1; signals from
# inside the container cannot kill PID 1, so the loop only ends at the deadline.
_KEEPER = 'trap "" TERM INT HUP; i=0; while [ "$i" -lt "$1" ]; do sleep 1 & wait $!; i=$((i+1)); done'
# Blocking exec streams each hold a thread; the pool bounds them across all trials.
_EXEC_POOL = ThreadPoolExecutor(max_workers=128, thread_name_prefix="sandbox-exec")
# Output kept per stream: the tail is what explains a failure.
MAX_OUTPUT_CHARS = 1_000_000
# Extra seconds the host waits past the in-container `timeout` before giving up on an exec.
_HOST_GRACE_S = 5.0
# What dockerd answers (exit 126) when an exec's process never started; every command
# runs under `timeout`, so a missing program is timeout's 127, never one of these.
_EXEC_START_FAILURES = ("failed to start io pipe copy", "OCI runtime exec failed")
_EXEC_START_TRIES = 3
# What Docker gives a container whose image sets no PATH.
_DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# Per daemon ID: None when container disk limits work, else why they do not.
_storage_support: dict[str, str | None] = {}
# Refusals already warned about under `unenforceable_storage: ignore`: one warning per daemon, not per trial.
_warned: set[str] = set()


def _tar(host_path: Path, arcname: str) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        tar.add(str(host_path), arcname=arcname)
    return buffer.getvalue()


def _bind_mounts(tools: tuple[ToolMount, ...]) -> list[Mount]:
    """Read-only bind mounts: the kernel refuses every write, whatever user the agent runs as
    (root included, since the container has no CAP_SYS_ADMIN to remount)."""
    for tool in tools:
        if not tool.source.is_absolute() or not tool.target.startswith("/"):
            raise SandboxError(f"tool mount {tool.source} -> {tool.target}: both paths must be absolute")
        if not tool.source.exists():
            raise SandboxError(f"tool mount source {tool.source} does not exist on this host")
    return [Mount(t.target, str(t.source.resolve()), type="bind", read_only=True) for t in tools]


def _image_path(client: docker.DockerClient, image_id: str) -> str:
    env = client.images.get(image_id).attrs.get("Config", {}).get("Env") or []
    return next((e.split("=", 1)[1] for e in env if e.startswith("PATH=")), _DEFAULT_PATH)


def _storage_size_support(client: docker.DockerClient, image_id: str) -> str | None:
    """None when this daemon can cap a container's writable layer, else why not. Asked once per
    daemon by creating (never starting) a container with a size: only overlay2 on xfs with
    pquota, btrfs and zfs accept one."""
    info = client.info()
    key = info.get("ID", "")
    if key not in _storage_support:
        try:
            client.containers.create(image_id, command=["true"], storage_opt={"size": "64M"}).remove(force=True)
            _storage_support[key] = None
        except docker.errors.APIError as exc:
            backing = dict(info.get("DriverStatus") or []).get("Backing Filesystem", "?")
            _storage_support[key] = (
                f"its storage driver ({info.get('Driver')} on {backing}) cannot limit a container's disk: "
                f"{exc.explanation or exc}"
            )
    return _storage_support[key]


def _start_failure(code: int | None, stdout: bytes | None, stderr: bytes | None) -> str | None:
    """dockerd's own message when it could not start an exec's process (exit 126), else None."""
    if code != 126:
        return None
    head = ((stdout or b"") + (stderr or b""))[:1000].decode("utf-8", errors="replace")
    return head.strip() if any(marker in head for marker in _EXEC_START_FAILURES) else None


def _decode_tail(data: bytes | None) -> str:
    text = (data or b"").decode("utf-8", errors="replace")
    return text[-MAX_OUTPUT_CHARS:]


class DockerSandbox:
    """A trial's container. Not thread-safe per instance; one trial drives it."""

    def __init__(
        self,
        spec: SandboxSpec,
        client: docker.DockerClient,
        network: ProxyNetwork | None,
        *,
        unenforceable_storage: Literal["refuse", "ignore"] = "refuse",
    ) -> None:
        self.spec = spec
        self._unenforceable_storage = unenforceable_storage
        self._client = client
        self._network = network
        self._container: Container | None = None
        self._deadline = 0.0
        # A trial cancelled while `start` runs in its worker thread calls `stop` before the container
        # exists; the lock and flag let `start` remove a container made after that stop.
        self._lock = threading.Lock()
        self._stopped = False

    @property
    def isolated(self) -> bool:
        return True

    @property
    def proxy_host(self) -> str:
        if self._network is None:
            raise SandboxError("this sandbox has no network (sandbox.network: none); it cannot reach a proxy")
        return self._network.gateway

    @property
    def container_id(self) -> str | None:
        return self._container.id if self._container is not None else None

    def start(self) -> None:
        if self._container is not None:
            raise SandboxError(f"sandbox {self.spec.trial_id} already started")
        memory = f"{self.spec.memory_mb}m"
        try:
            image_id = ensure_task_image(
                self._client, self.spec.environment_dir, self.spec.docker_image, self.spec.build_timeout_s
            )
            env = dict(self.spec.env)
            if self.spec.path_prefix:
                # Container-wide, so every exec (the install check, the CLI, the agent's own shells) finds the tools.
                env["PATH"] = ":".join([*self.spec.path_prefix, _image_path(self._client, image_id)])
            mounts = _bind_mounts(self.spec.tool_mounts)
            storage_opt = None
            if self.spec.storage_mb is not None:
                refusal = _storage_size_support(self._client, image_id)
                if refusal is None:
                    storage_opt = {"size": f"{self.spec.storage_mb}M"}
                elif self._unenforceable_storage == "refuse":
                    # Unenforced, the limit would be a promise an agent can break (and fill the host's disk).
                    raise SandboxError(
                        f"the task sets environment.storage_mb = {self.spec.storage_mb}, but this Docker daemon "
                        f"cannot enforce it: {refusal}; set sandbox.unenforceable_storage: ignore to run such "
                        "tasks without a disk limit"
                    )
                elif refusal not in _warned:
                    _warned.add(refusal)
                    log.warning(
                        "running tasks with storage_mb WITHOUT a disk limit "
                        "(sandbox.unenforceable_storage: ignore): this Docker daemon %s",
                        refusal,
                    )
            self._deadline = time.time() + self.spec.wall_clock_s
            container = self._client.containers.run(
                image_id,
                entrypoint=["sh", "-c", _KEEPER, "keeper"],
                command=[str(int(self.spec.wall_clock_s) + 1)],
                detach=True,
                hostname="sandbox",
                labels=reaper.labels(self.spec.trial_id, self._deadline),
                environment=env,
                mounts=mounts,
                nano_cpus=int(self.spec.cpus * 1e9),
                mem_limit=memory,
                memswap_limit=memory,  # no swap: hitting the limit is an OOM, not a crawl
                pids_limit=self.spec.pids_limit,
                storage_opt=storage_opt,
                network=self._network.name if self._network is not None else None,
                network_mode=None if self._network is not None else "none",
                security_opt=["no-new-privileges"],
            )
            with self._lock:
                stopped = self._stopped
                if not stopped:
                    self._container = container
            if stopped:
                container.remove(force=True, v=True)
                raise SandboxError(f"sandbox {self.spec.trial_id} was stopped while it started")
        except docker.errors.DockerException as exc:
            raise SandboxError(f"cannot start a container for trial {self.spec.trial_id}: {exc}") from exc

    def _require(self) -> Container:
        if self._container is None:
            raise SandboxError(f"sandbox {self.spec.trial_id} is not started")
        return self._container

    def _run_exec(
        self, argv: list[str], env: dict[str, str] | None, workdir: str | None, user: str
    ) -> tuple[int | None, bytes | None, bytes | None]:
        api = self._client.api
        exec_id = api.exec_create(self._require().id, argv, environment=env, workdir=workdir, user=user)["Id"]
        stdout, stderr = api.exec_start(exec_id, demux=True)
        return api.exec_inspect(exec_id).get("ExitCode"), stdout, stderr

    def exec(
        self,
        cmd: str | list[str],
        *,
        timeout: float,
        env: dict[str, str] | None = None,
        workdir: str | None = None,
        user: str = ROOT_USER,
    ) -> ExecResult:
        # coreutils `timeout` signals the command's whole process group inside the container;
        # the host-side wait is only the backstop for a container that stops answering.
        argv = ["timeout", "-k", "2", f"{max(timeout, 0.001):.3f}", *as_argv(cmd)]
        return self._exec_argv(argv, timeout, env, workdir, user)

    def _exec_argv(
        self, argv: list[str], timeout: float, env: dict[str, str] | None, workdir: str | None, user: str
    ) -> ExecResult:
        for attempt in range(_EXEC_START_TRIES):
            started = time.monotonic()
            future = _EXEC_POOL.submit(self._run_exec, argv, env, workdir or self.spec.workdir, user)
            try:
                code, stdout, stderr = future.result(timeout=timeout + _HOST_GRACE_S)
            except FutureTimeout:
                return ExecResult(
                    None, "", f"exec did not return within {timeout + _HOST_GRACE_S:.0f}s", timed_out=True
                )
            except docker.errors.DockerException as exc:
                raise SandboxError(
                    f"exec in trial {self.spec.trial_id} failed: {self.failure_reason() or exc}"
                ) from exc
            start_failure = _start_failure(code, stdout, stderr)
            if start_failure is None:
                break
            # The daemon never started the process (seen under load): safe to ask again.
            time.sleep(0.5 * (attempt + 1))
        else:
            raise SandboxError(f"Docker could not start a process in trial {self.spec.trial_id}: {start_failure}")
        timed_out = code in (124, 137) and time.monotonic() - started >= timeout
        return ExecResult(code, _decode_tail(stdout), _decode_tail(stderr), timed_out=timed_out)

    def _checked(self, cmd: list[str], what: str) -> None:
        result = self.exec(cmd, timeout=60)
        if not result.ok:
            raise SandboxError(
                f"{what} failed in trial {self.spec.trial_id}: {result.stderr.strip() or result.exit_code}"
            )

    def copy_in(self, host_path: Path, sandbox_path: str) -> None:
        host_path = Path(host_path)
        if not host_path.exists():
            raise SandboxError(f"copy_in: {host_path} does not exist")
        parent, name = posixpath.split(posixpath.normpath(sandbox_path))
        archive = _tar(host_path, name)
        container = self._require()
        for attempt in range(2):
            try:
                container.put_archive(parent, archive)
                return
            except docker.errors.NotFound as exc:
                if attempt:
                    raise SandboxError(f"copy_in: cannot create {parent} in trial {self.spec.trial_id}") from exc
                # Only a missing parent costs this extra round trip to the daemon.
                self._checked(["mkdir", "-p", "--", parent], f"creating {parent}")
            except docker.errors.DockerException as exc:
                raise SandboxError(f"copy_in {host_path} -> {sandbox_path} failed: {exc}") from exc

    def copy_out(self, sandbox_path: str, host_path: Path) -> None:
        host_path = Path(host_path)
        try:
            stream, _ = self._require().get_archive(sandbox_path)
        except docker.errors.NotFound as exc:
            raise SandboxError(f"copy_out: {sandbox_path} does not exist in trial {self.spec.trial_id}") from exc
        except docker.errors.DockerException as exc:
            raise SandboxError(f"copy_out {sandbox_path} failed: {exc}") from exc
        with tempfile.TemporaryDirectory(prefix="legorl-copy-") as tmp:
            archive = Path(tmp) / "out.tar"
            with archive.open("wb") as fh:
                for chunk in stream:
                    fh.write(chunk)
            try:
                with tarfile.open(archive) as tar:
                    # "data" refuses absolute paths, links out of the tree and device files.
                    tar.extractall(Path(tmp) / "x", filter="data")
            except tarfile.TarError as exc:
                raise SandboxError(f"copy_out {sandbox_path}: refused archive entry: {exc}") from exc
            extracted = Path(tmp) / "x" / posixpath.basename(posixpath.normpath(sandbox_path))
            if host_path.is_dir() and not host_path.is_symlink():
                shutil.rmtree(host_path)
            elif host_path.exists():
                host_path.unlink()
            host_path.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(str(extracted), host_path)

    def kill_all_processes(self) -> None:
        # kill(-1) reaches every process in the container but PID 1 (the keeper) and the caller.
        # No `timeout` wrapper here: kill(-1) would take the wrapper down with everything else.
        self._exec_argv(["sh", "-c", "kill -9 -1 2>/dev/null; exit 0"], 10, None, "/", ROOT_USER)

    def failure_reason(self) -> str | None:
        container = self._require()
        try:
            container.reload()
        except docker.errors.NotFound:
            return "container was removed during the trial"
        state = container.attrs.get("State", {})
        if state.get("OOMKilled"):
            return f"out of memory (limit {self.spec.memory_mb} MB)"
        if not state.get("Running"):
            if time.time() >= self._deadline:
                return f"wall-clock limit of {self.spec.wall_clock_s:.0f}s reached"
            return f"container stopped (exit code {state.get('ExitCode')})"
        return None

    def oom_kill_count(self) -> int | None:
        # The memory cgroup counts kills of *any* process (PID 1 survives most, so Docker's
        # OOMKilled flag stays false). cgroup v2 names the file memory.events, v1 memory.oom_control.
        result = self._exec_argv(
            ["cat", "/sys/fs/cgroup/memory.events", "/sys/fs/cgroup/memory/memory.oom_control"],
            10,
            None,
            "/",
            ROOT_USER,
        )
        counts = [int(line.split()[1]) for line in result.stdout.splitlines() if line.startswith("oom_kill ")]
        return max(counts) if counts else None

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            container = self._container
        if container is None:
            return
        try:
            container.remove(force=True, v=True)
        except docker.errors.NotFound:
            pass
        except docker.errors.APIError as exc:
            # Already being removed by the reaper or a concurrent stop: both end the same way.
            if "already in progress" not in str(exc):
                raise SandboxError(f"cannot remove container of trial {self.spec.trial_id}: {exc}") from exc
