"""The gRPC `RolloutService`: requests become trials, trials become a stream.

Bounded concurrency: at most `capacity` trials run at once; up to
`max_queued` more wait; a request that would overflow the queue is refused
with RESOURCE_EXHAUSTED (backpressure the fleet client understands). When the
client goes away its trials are cancelled, and cancelled trials still tear
their sandboxes down. While draining (SIGTERM), new requests are refused and
in-flight ones finish.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import grpc

from legorl_jax import __version__
from protos.legorl.v1 import rollout_pb2 as pb
from protos.legorl.v1 import rollout_pb2_grpc as pb_grpc
from rollout_server.backends.client import EngineClient, EngineError
from rollout_server.harnesses import get_harness, harness_names
from rollout_server.harnesses.base import HarnessConfigError
from rollout_server.tasks import Task, TaskError, load_task
from rollout_server.trial import TrialHost, TrialSpec, run_trial
from rollout_server.weights import WeightTransferError, receive_stream, resolve_location

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ServiceLimits:
    capacity: int = 8
    max_queued: int = 256
    agent_timeout_s: float = 600.0
    verifier_timeout_s: float = 120.0


class RolloutService(pb_grpc.RolloutServiceServicer):
    def __init__(
        self,
        host: TrialHost,
        engine: EngineClient,
        tasks: dict[str, Task],
        weights_root: Path,
        limits: ServiceLimits = ServiceLimits(),
    ) -> None:
        self.host = host
        self.weights_root = weights_root
        self.engine = engine
        self.tasks = tasks
        self.limits = limits
        self.draining = False
        self._slots = asyncio.Semaphore(limits.capacity)
        self._running = 0
        self._queued = 0
        self._weights_lock = asyncio.Lock()
        self._idle = asyncio.Event()
        self._idle.set()

    # ------------------------------------------------------------- Rollout --

    def _resolve_task(self, ref: pb.TaskRef) -> Task:
        if ref.location:
            return load_task(ref.location)
        try:
            return self.tasks[ref.task_id]
        except KeyError:
            raise TaskError(ref.task_id, "", f"unknown task id (this server knows {len(self.tasks)} tasks)") from None

    def _trials(self, request: pb.RolloutRequest) -> list[TrialSpec]:
        if request.group_size < 1:
            raise ValueError("group_size must be at least 1")
        if not request.tasks or not request.harness_configs:
            raise ValueError("a request needs at least one task and one harness config")
        limits = request.limits
        agent_s = limits.agent_timeout_s or self.limits.agent_timeout_s
        verifier_s = limits.verifier_timeout_s or self.limits.verifier_timeout_s
        specs = []
        for ref in request.tasks:
            task = self._resolve_task(ref)
            for harness_config in request.harness_configs:
                options = get_harness(harness_config.name).parse_options(harness_config.options_json or None)
                for index in range(request.group_size):
                    specs.append(
                        TrialSpec(
                            trial_id=f"{request.request_id or 'req'}-{uuid.uuid4().hex[:10]}",
                            task=task,
                            harness=harness_config,
                            options=options,
                            sampling=request.sampling,
                            limits=limits,
                            labels=dict(request.labels),
                            agent_timeout_s=agent_s,
                            verifier_timeout_s=verifier_s,
                        )
                    )
        return specs

    async def Rollout(
        self, request: pb.RolloutRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.Trajectory]:
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "server is draining")
        if request.policy_version > self.host.policy_version:
            # The weights the caller expects have not arrived; a newer policy is fine
            # (each sequence records the version that sampled it; the trainer bounds lag).
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"engine serves policy version {self.host.policy_version}, request wants {request.policy_version}",
            )
        try:
            specs = self._trials(request)
        except (ValueError, TaskError, HarnessConfigError) as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if self._queued + len(specs) > self.limits.max_queued + self.limits.capacity:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{self._queued} trials already queued; at most {self.limits.max_queued} wait",
            )
        self._queued += len(specs)
        self._idle.clear()
        pending = {asyncio.create_task(self._one(spec, request.request_id)): spec for spec in specs}
        try:
            for finished in asyncio.as_completed(pending):
                yield await finished
        finally:
            for task in pending:
                task.cancel()
            # Let cancelled trials tear their sandboxes down before the call ends.
            await asyncio.gather(*pending, return_exceptions=True)

    async def _one(self, spec: TrialSpec, request_id: str) -> pb.Trajectory:
        started = False
        try:
            async with self._slots:
                started = True
                self._queued -= 1
                self._running += 1
                try:
                    trajectory = await run_trial(self.host, spec)
                finally:
                    self._running -= 1
        finally:
            if not started:  # cancelled while still queued
                self._queued -= 1
            if self._running == 0 and self._queued == 0:
                self._idle.set()
        trajectory.request_id = request_id
        return trajectory

    # ------------------------------------------------------------- Weights --

    async def UpdateWeights(
        self, request: pb.UpdateWeightsRequest, context: grpc.aio.ServicerContext
    ) -> pb.UpdateWeightsResponse:
        if not request.location:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "location is empty")
        async with self._weights_lock:
            try:
                directory = await asyncio.to_thread(resolve_location, request.location, self.weights_root)
            except WeightTransferError as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            return await self._load(request.version, directory, context, how="from its location")

    async def StreamWeights(
        self, request_iterator: AsyncIterator[pb.WeightChunk], context: grpc.aio.ServicerContext
    ) -> pb.UpdateWeightsResponse:
        async with self._weights_lock:
            try:
                version, directory = await receive_stream(request_iterator, self.weights_root)
            except WeightTransferError as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            return await self._load(version, directory, context, how="streamed")

    async def _load(
        self, version: int, directory: Path, context: grpc.aio.ServicerContext, *, how: str
    ) -> pb.UpdateWeightsResponse:
        """pause → reload → reset prefix cache → resume; new trials then carry `version`."""
        started = time.monotonic()
        try:
            await self.engine.update_weights(str(directory))
        except EngineError as exc:
            await context.abort(grpc.StatusCode.INTERNAL, f"engine reload of {directory} failed: {exc}")
        self.host.policy_version = version
        reload_s = time.monotonic() - started
        log.info("policy version %d loaded (%s) in %.2f s", version, how, reload_s)
        return pb.UpdateWeightsResponse(loaded_version=version, reload_s=reload_s)

    # -------------------------------------------------------------- Status --

    async def GetStatus(self, request: pb.GetStatusRequest, context: grpc.aio.ServicerContext) -> pb.ServerStatus:
        return pb.ServerStatus(
            capacity=self.limits.capacity,
            in_flight_trials=self._running,
            queued_trials=max(0, self._queued),
            loaded_policy_version=self.host.policy_version,
            engine_healthy=await self.engine.healthy(),
            server_version=f"legorl-jax {__version__} (legorl.v1)",
            harnesses=harness_names(),
            draining=self.draining,
        )

    async def drain(self, grace_s: float) -> bool:
        """Refuses new work and waits for in-flight trials; True when all finished in time."""
        self.draining = True
        try:
            await asyncio.wait_for(self._idle.wait(), grace_s)
            return True
        except TimeoutError:
            return False
