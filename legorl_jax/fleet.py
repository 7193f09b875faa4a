"""The trainer's client of the rollout fleet.

Many rollout servers, each a `RolloutService` behind one address. A group (one
task × one harness config × `group_size` trials) is one `Rollout` call, sent
to the live server with the most free trial slots. When a server dies
mid-stream, the trials it still owed are re-issued to another server; after
`max_retries` re-issues they come back as ungraded env failures, so the
learner drops them rather than waiting forever.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import uuid
from collections.abc import AsyncIterator, Callable, Iterable
from pathlib import Path

import grpc

from legorl_jax.core.aio import completion_order
from legorl_jax.core.config import FleetConfig, GrpcSecurityConfig
from legorl_jax.core.grpc_auth import Keepalive, client_security
from legorl_jax.core.seeds import derive_seed
from protos.legorl.v1 import rollout_pb2 as pb
from protos.legorl.v1 import rollout_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

# Codes that mean "this server is gone or unusable", not "the request is bad".
_SERVER_LOST = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}


class FleetError(RuntimeError):
    """No live server can take work, or a server rejected a request outright."""


@dataclasses.dataclass(frozen=True)
class GroupSpec:
    """One GRPO group to roll out."""

    task: pb.TaskRef
    harness: pb.HarnessConfig
    group_size: int
    sampling: pb.SamplingParams
    policy_version: int
    limits: pb.TrialLimits = dataclasses.field(default_factory=pb.TrialLimits)
    labels: tuple[tuple[str, str], ...] = ()


@dataclasses.dataclass
class GroupResult:
    spec: GroupSpec
    group_id: str
    trajectories: list[pb.Trajectory]
    reissues: int = 0


@dataclasses.dataclass
class _Server:
    address: str
    stub: pb_grpc.RolloutServiceStub
    channel: grpc.aio.Channel
    capacity: int = 0
    busy: int = 0
    alive: bool = False
    last_error: str = ""

    @property
    def free(self) -> int:
        return self.capacity - self.busy if self.alive else -1


class Fleet:
    """Spreads groups over rollout servers by free capacity, re-issuing lost trials."""

    def __init__(
        self,
        addresses: Iterable[str],
        *,
        max_retries: int = 2,
        rpc_timeout_s: float = 3600.0,
        probe_interval_s: float = 2.0,
        wait_for_servers_s: float = 60.0,
        security: GrpcSecurityConfig | None = None,
        keepalive: Keepalive = Keepalive(),
    ) -> None:
        self._addresses = list(addresses)
        if not self._addresses:
            raise FleetError("no rollout server addresses given")
        # Also what a weight streamer to these servers uses. A missing CA file or token fails here,
        # not at the first call.
        self.security = client_security(security or GrpcSecurityConfig())
        # Per server, the probe difference its last UpdateWeights reported (rollout.proto).
        self.probe_diffs: dict[str, float] = {}
        self._max_retries = max_retries
        self._rpc_timeout_s = rpc_timeout_s
        self._probe_interval_s = probe_interval_s
        self._wait_for_servers_s = wait_for_servers_s
        # A stalled server (stopped, wedged) fails its streams after time_s + timeout_s, and its trials are re-issued.
        self._keepalive = keepalive
        self._servers: list[_Server] = []
        self._slot_freed = asyncio.Condition()
        self._ids = itertools.count()

    @property
    def addresses(self) -> list[str]:
        return list(self._addresses)

    async def __aenter__(self) -> Fleet:
        for address in self._addresses:
            channel = self.security.channel(address, self._keepalive)
            self._servers.append(_Server(address, pb_grpc.RolloutServiceStub(channel), channel))
        await self.refresh()
        if not any(s.alive for s in self._servers):
            why = ", ".join(f"{s.address} ({s.last_error})" for s in self._servers)
            raise FleetError(f"no rollout server answered GetStatus: {why}")
        return self

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.gather(*(s.channel.close() for s in self._servers))

    async def refresh(self) -> None:
        """Asks every server for its status; marks the silent ones dead."""
        await asyncio.gather(*(self._probe(s) for s in self._servers))
        async with self._slot_freed:
            self._slot_freed.notify_all()

    async def _probe(self, server: _Server) -> None:
        try:
            status = await server.stub.GetStatus(pb.GetStatusRequest(), timeout=5.0, metadata=self.security.metadata)
        except grpc.aio.AioRpcError as exc:
            server.last_error = f"{exc.code().name}: {exc.details()}"
            if server.alive:
                log.warning("rollout server %s lost: %s", server.address, exc.code().name)
            server.alive = False
            return
        server.capacity = max(1, status.capacity)
        server.alive = not status.draining

    def statuses(self) -> dict[str, dict[str, int | bool]]:
        return {s.address: {"alive": s.alive, "capacity": s.capacity, "busy": s.busy} for s in self._servers}

    async def update_weights(self, version: int, location: str) -> dict[str, int]:
        """Loads `version` on every live server; returns the version each reports."""

        async def one(server: _Server) -> tuple[str, int]:
            reply = await server.stub.UpdateWeights(
                pb.UpdateWeightsRequest(version=version, location=location),
                timeout=self._rpc_timeout_s,
                metadata=self.security.metadata,
            )
            self.probe_diffs[server.address] = reply.probe_max_abs_diff
            return server.address, reply.loaded_version

        self.probe_diffs = {}

        await self.refresh()  # a server marked dead may be back; it must get the weights too
        live = [s for s in self._servers if s.alive]
        results = await asyncio.gather(*(one(s) for s in live), return_exceptions=True)
        loaded: dict[str, int] = {}
        for server, result in zip(live, results, strict=True):
            if isinstance(result, BaseException):
                log.warning("UpdateWeights failed on %s: %s; marking it dead", server.address, result)
                server.alive = False
            else:
                loaded[result[0]] = result[1]
        if not loaded:
            raise FleetError(f"no server loaded policy version {version}")
        return loaded

    async def rollout(self, specs: Iterable[GroupSpec]) -> AsyncIterator[GroupResult]:
        """Runs every group; yields each as soon as all its trials are back."""
        tasks = [asyncio.create_task(self._run_group(spec)) for spec in specs]
        async with completion_order(tasks) as finished:
            for next_done in finished:
                yield await next_done

    async def _acquire(self, slots: int) -> _Server:
        """Reserves `slots` on the live server with the most free slots (an idle one
        takes a group larger than its capacity: it queues the rest itself)."""
        waited = 0.0
        while True:
            async with self._slot_freed:
                live = [s for s in self._servers if s.alive]
                if live:
                    best = max(live, key=lambda s: s.free)
                    if best.free >= slots or best.busy == 0:
                        best.busy += slots
                        return best
                    await self._slot_freed.wait()
                    continue
            if waited >= self._wait_for_servers_s:
                raise FleetError(f"every rollout server has been down for {waited:.0f}s")
            await asyncio.sleep(self._probe_interval_s)
            waited += self._probe_interval_s
            await self.refresh()

    async def _release(self, server: _Server, slots: int) -> None:
        async with self._slot_freed:
            server.busy -= slots
            self._slot_freed.notify_all()

    async def _run_group(self, spec: GroupSpec) -> GroupResult:
        group_id = f"g{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        received: list[tuple[int, pb.Trajectory]] = []  # (request round, the trajectory)
        reissues = 0
        while len(received) < spec.group_size:
            missing = spec.group_size - len(received)
            server = await self._acquire(missing)
            sampling = pb.SamplingParams()
            sampling.CopyFrom(spec.sampling)
            if reissues and sampling.seed:  # re-issued trials must not repeat the samples of those that came back
                sampling.seed = derive_seed(sampling.seed, "reissue", reissues)
            request = pb.RolloutRequest(
                request_id=f"{group_id}-{reissues}",
                tasks=[spec.task],
                harness_configs=[spec.harness],
                group_size=missing,
                sampling=sampling,
                policy_version=spec.policy_version,
                limits=spec.limits,
                labels=dict(spec.labels),
            )
            try:
                call = server.stub.Rollout(request, timeout=self._rpc_timeout_s, metadata=self.security.metadata)
                async for trajectory in call:
                    trajectory.group_id = group_id
                    received.append((reissues, trajectory))
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in _SERVER_LOST:
                    raise FleetError(f"{server.address} rejected group {group_id}: {exc.details()}") from exc
                server.alive = False
                log.warning(
                    "server %s lost mid-group %s (%s); %d trials owed",
                    server.address,
                    group_id,
                    exc.code().name,
                    spec.group_size - len(received),
                )
                reissues += 1
                if reissues > self._max_retries:
                    received.extend(
                        (reissues, _lost_trial(spec, group_id, i, f"lost after {reissues} servers died"))
                        for i in range(spec.group_size - len(received))
                    )
                asyncio.get_running_loop().call_later(self._probe_interval_s, self._schedule_probe, server)
            finally:
                await self._release(server, missing)
        # In the order the trials were asked for, not the order they ended in: the same seeds give the
        # same group, trajectory for trajectory (the server numbers each request's trials).
        received.sort(key=lambda item: (item[0], item[1].trial_index))
        trajectories = [t for _, t in received]
        for index, trajectory in enumerate(trajectories):
            trajectory.trial_index = index
        return GroupResult(spec, group_id, trajectories, reissues)

    def _schedule_probe(self, server: _Server) -> None:
        asyncio.ensure_future(self._probe_and_notify(server))

    async def _probe_and_notify(self, server: _Server) -> None:
        await self._probe(server)
        async with self._slot_freed:
            self._slot_freed.notify_all()


# Starts a rollout server in this process on the given weights; yields its address.
LocalServer = Callable[[Path], contextlib.AbstractAsyncContextManager[str]]


@contextlib.asynccontextmanager
async def configured_fleet(config: FleetConfig, local_server: LocalServer, model_dir: Path) -> AsyncIterator[Fleet]:
    """The configured servers, or, when the config lists none, one started in
    this process on `model_dir` (stopped on exit)."""
    async with contextlib.AsyncExitStack() as stack:
        addresses = list(config.servers)
        if not addresses:
            addresses = [await stack.enter_async_context(local_server(model_dir))]
        async with Fleet(
            addresses, max_retries=config.max_retries, rpc_timeout_s=config.rpc_timeout_s, security=config.security
        ) as fleet:
            yield fleet


def _lost_trial(spec: GroupSpec, group_id: str, index: int, reason: str) -> pb.Trajectory:
    return pb.Trajectory(
        task_id=spec.task.task_id,
        group_id=group_id,
        trial_index=index,
        harness=spec.harness,
        status=pb.TRIAL_STATUS_ENV_FAILURE,
        error=reason,
        sampling=spec.sampling,
    )
