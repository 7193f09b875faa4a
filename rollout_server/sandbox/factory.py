"""`SandboxFactory`, what the rollout server holds: it decides Docker or local
once (never local by surprise: that takes `kind="local"` or an explicit
`allow_local_fallback`), prepares the proxy-only network, reaps orphans at
start-up (containers, or local sandboxes' directories), and makes one sandbox
per trial from a task (`spec_for_task`)."""

from __future__ import annotations

import logging
from typing import Literal

# Aliased to read apart from the sibling module `sandbox.docker` (DockerSandbox).
import docker as docker_sdk
import docker.errors as docker_errors

from rollout_server.sandbox.base import Sandbox, SandboxError, SandboxSpec
from rollout_server.sandbox.docker import DockerSandbox
from rollout_server.sandbox.local import LocalSandbox, bwrap_path, reap_local_dirs
from rollout_server.sandbox.network import ProxyNetwork, ensure_proxy_network, reap_stale_networks, remove_proxy_network
from rollout_server.sandbox.reaper import Reaper
from rollout_server.tasks import Task

log = logging.getLogger(__name__)


def docker_client_or_none() -> docker_sdk.DockerClient | None:
    """A client when a Docker daemon answers, else None."""
    try:
        # Every running exec holds a connection; the SDK's default pool of 10 would churn them.
        client = docker_sdk.from_env(timeout=120, max_pool_size=128)
        client.ping()
        return client
    except docker_errors.DockerException:
        return None


def spec_for_task(
    task: Task,
    trial_id: str,
    *,
    pids_limit: int = 512,
    wall_clock_s: float | None = None,
    max_cpus: float | None = None,
    max_memory_mb: int | None = None,
) -> SandboxSpec:
    """A trial's sandbox spec: the task's own limits, capped by the server's."""
    env = task.config.environment
    if wall_clock_s is None:
        # Agent + verifier budgets plus slack for set-up and copies.
        wall_clock_s = task.config.agent.timeout_sec + task.config.verifier.timeout_sec + 120.0
    return SandboxSpec(
        trial_id=trial_id,
        environment_dir=task.environment_dir if task.dockerfile is not None else None,
        docker_image=env.docker_image,
        cpus=min(env.cpus, max_cpus) if max_cpus else env.cpus,
        memory_mb=min(env.memory_mb, max_memory_mb) if max_memory_mb else env.memory_mb,
        storage_mb=env.storage_mb,
        pids_limit=pids_limit,
        wall_clock_s=wall_clock_s,
        build_timeout_s=env.build_timeout_sec,
    )


def _warn_local(kind: str, network: str) -> None:
    """Says loudly, once per server, what the local sandbox leaves open."""
    why = "sandbox.kind is local" if kind == "local" else "no Docker daemon answers (sandbox.allow_local_fallback)"
    if bwrap_path() is None:
        reach = "no bubblewrap: agents share the host's network (engine, gRPC, proxy and every other service)"
    elif network == "proxy_only":
        reach = "bubblewrap: each command has its own network namespace reaching only the proxy"
    else:
        reach = "bubblewrap: each command has its own network namespace reaching nothing"
    log.warning(
        "%s: trials run in the LOCAL sandbox, which is NOT isolated (host kernel and system files, no cgroup "
        "limits); %s. Use Docker for training.",
        why,
        reach,
    )


class SandboxFactory:
    """Makes trial sandboxes of one kind; `close()` stops the reaper."""

    def __init__(
        self,
        kind: Literal["auto", "docker", "local"] = "auto",
        network: Literal["proxy_only", "none"] = "proxy_only",
        proxy_port: int | None = None,
        reap_interval_s: float = 30.0,
        allow_local_fallback: bool = False,
        unenforceable_storage: Literal["refuse", "ignore"] = "refuse",
    ) -> None:
        self._unenforceable_storage: Literal["refuse", "ignore"] = unenforceable_storage
        client = docker_client_or_none() if kind in ("auto", "docker") else None
        if kind == "docker" and client is None:
            raise SandboxError("sandbox.kind is docker but no Docker daemon answers")
        if kind == "auto" and client is None and not allow_local_fallback:
            # The local sandbox is no place for a policy under training: never switch to it silently.
            raise SandboxError(
                "no Docker daemon answers and sandbox.kind is auto: start Docker, or accept the unisolated "
                "local sandbox with sandbox.kind: local or sandbox.allow_local_fallback: true"
            )
        self.kind: Literal["docker", "local"] = "docker" if client is not None else "local"
        self._client = client
        self._network_mode = network
        self._proxy_port = proxy_port
        self._network: ProxyNetwork | None = None
        self._reaper: Reaper | None = None
        if client is not None:
            if network == "proxy_only" and proxy_port is None:
                raise SandboxError("proxy_only networking needs the proxy's port")
            # Orphaned containers first: they keep dead servers' networks in use.
            self._reaper = Reaper(client, reap_interval_s)
            reaped = self._reaper.start()
            if reaped:
                log.info("reaped %d orphaned trial containers at start-up", len(reaped))
            if network == "proxy_only" and proxy_port is not None:  # None is refused above
                stale = reap_stale_networks(client)
                if stale:
                    log.info("removed %d proxy networks of servers that are gone", len(stale))
                self._network = ensure_proxy_network(client, proxy_port)
        else:
            _warn_local(kind, network)
            reaped_dirs = reap_local_dirs()
            if reaped_dirs:
                log.info("removed %d local sandboxes of servers that are gone", len(reaped_dirs))

    @property
    def client(self) -> docker_sdk.DockerClient | None:
        return self._client

    @property
    def network(self) -> ProxyNetwork | None:
        return self._network

    def create(self, spec: SandboxSpec) -> Sandbox:
        """An unstarted sandbox for one trial; the caller starts and always stops it."""
        if self._client is not None:
            return DockerSandbox(spec, self._client, self._network, unenforceable_storage=self._unenforceable_storage)
        if self._network_mode == "proxy_only" and self._proxy_port is not None:
            return LocalSandbox(spec, network="proxy_only", proxy_port=self._proxy_port)
        return LocalSandbox(spec, network="none")

    def close(self) -> None:
        """Call once every sandbox is stopped: the proxy network goes with its server."""
        if self._reaper is not None:
            self._reaper.stop()
        if self._client is not None and self._network is not None:
            try:
                remove_proxy_network(self._client, self._network.proxy_port)
            except docker_errors.APIError as exc:
                log.warning(
                    "proxy network %s still in use; the next server's start-up reaps it: %s", self._network.name, exc
                )
            self._network = None
