"""The gRPC `RolloutService`: requests become trials, trials become a stream.

Bounded concurrency: at most `capacity` trials run at once; up to
`max_queued` more wait; a request that would overflow the queue is refused
with RESOURCE_EXHAUSTED (backpressure the fleet client understands), one that
could never fit, or breaks any other bound, with INVALID_ARGUMENT, all before
a single trial is expanded. When the client goes away its trials are
cancelled, and cancelled trials still tear their sandboxes down. While
draining (SIGTERM), new requests are refused and in-flight ones finish; those
still running when the grace ends are cancelled and stream out as CANCELLED.

No handler lets an exception escape as gRPC's UNKNOWN: a bad request gets a
precise code and message, a fault of the server's own is logged and answered
INTERNAL, and the server keeps serving either way.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import grpc
from pydantic import ValidationError

from legorl_jax.core.aio import completion_order
from legorl_jax.core.config import SessionCaps
from legorl_jax.core.grpc_auth import ClientSecurity
from legorl_jax.core.seeds import derive_seed
from legorl_jax.core.version import __version__
from legorl_jax.core.weight_layout import WeightTransferError, read_manifest
from legorl_jax.core.weight_probe import ProbeResult
from protos.legorl.v1 import rollout_pb2 as pb
from protos.legorl.v1 import rollout_pb2_grpc as pb_grpc
from rollout_server.backends.adapters import AdapterRoute
from rollout_server.backends.client import EngineClient, EngineError
from rollout_server.backends.served_probe import ProbeFailed, failure, probe_engine
from rollout_server.harnesses import get_harness, harness_names
from rollout_server.harnesses.base import HarnessConfigError, HarnessOptions
from rollout_server.served_base import ServedBase
from rollout_server.served_tensors import ServedTensors
from rollout_server.tasks import Task, TaskError, confined_task_dir, load_task
from rollout_server.trial import TrialHost, TrialSpec, run_trial, sampling_config
from rollout_server.weight_relay import WeightRelay
from rollout_server.weights import WeightBaseMismatch, WeightStreamStalled, receive_stream, resolve_location

log = logging.getLogger(__name__)

# Sizes a Rollout request's fields may have. Far above what the trainer sends; they keep one request
# (the server accepts 64 MiB messages, for weight headers) from costing more than its trials are worth.
MAX_REQUEST_BYTES = 2**20
MAX_NAME_CHARS = 256  # request_id, task_id, harness name, config_id, label keys
MAX_LOCATION_CHARS = 4096
MAX_OPTIONS_JSON_BYTES = 64 * 2**10
MAX_LABELS = 64
MAX_LABEL_VALUE_CHARS = 1024
MAX_STOP_TOKEN_IDS = 64
MAX_RELAY_HOPS = 1024  # servers one StreamWeights header may name to relay to
# After the drain grace, how long cancelled trials get to tear their sandboxes down and stream out.
CANCEL_WAIT_S = 30.0


@dataclasses.dataclass(frozen=True)
class ServiceLimits:
    capacity: int = 8
    max_queued: int = 256
    agent_timeout_s: float = 600.0
    verifier_timeout_s: float = 120.0
    # The longest agent or verifier timeout a request may ask for.
    max_trial_timeout_s: float = 3600.0
    # The engine's context: no completion can be longer.
    max_tokens: int = 4096
    # A StreamWeights sender silent this long is dropped, so it cannot hold the weights lock.
    weights_idle_timeout_s: float = 120.0
    # How long a restart of the engine (after a failed probe) may take to come back.
    engine_restart_timeout_s: float = 900.0


class Refused(Exception):
    """A request the server will not run, with the status code and message its caller gets."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def _invalid(message: str) -> Refused:
    return Refused(grpc.StatusCode.INVALID_ARGUMENT, message)


Handler = TypeVar("Handler", bound=Callable[..., Awaitable[Any]])


def _guarded(handler: Handler) -> Handler:
    """Answers a unary handler's `Refused` with its code and any unexpected exception with
    INTERNAL (logged), instead of the UNKNOWN grpc would send with the exception's text."""

    @functools.wraps(handler)
    async def wrapped(self: RolloutService, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await handler(self, request, context)
        except Refused as exc:
            await context.abort(exc.code, str(exc))
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await _internal(context, handler.__name__, exc)

    return wrapped  # type: ignore[return-value]


async def _internal(context: grpc.aio.ServicerContext, method: str, exc: Exception) -> NoReturn:
    log.exception("%s failed inside the rollout server", method)
    await context.abort(grpc.StatusCode.INTERNAL, f"rollout server fault in {method}: {exc!r}"[:2000])
    raise AssertionError("abort returned")  # abort always raises


async def _relay_checked(messages: AsyncIterator[pb.WeightChunk]) -> AsyncIterator[pb.WeightChunk]:
    """A StreamWeights stream whose header's relay chain is bounded before anyone is called."""
    async for message in messages:
        if message.WhichOneof("payload") == "header":
            relay_to = message.header.relay_to
            if len(relay_to) > MAX_RELAY_HOPS:
                raise _invalid(f"relay_to names {len(relay_to)} servers; at most {MAX_RELAY_HOPS}")
            for address in relay_to:
                if not address:
                    raise _invalid("relay_to names an empty address")
                _check_len("relay_to address", address, MAX_NAME_CHARS)
        yield message


def _check_request(request: pb.RolloutRequest, limits: ServiceLimits, caps: SessionCaps) -> None:
    """Every bound of a Rollout request, checked on the request as sent: nothing is expanded or loaded yet."""
    size = request.ByteSize()
    if size > MAX_REQUEST_BYTES:
        raise _invalid(f"request is {size} bytes; at most {MAX_REQUEST_BYTES}")
    _check_len("request_id", request.request_id, MAX_NAME_CHARS)
    if request.group_size < 1:
        raise _invalid("group_size must be at least 1")
    if not request.tasks or not request.harness_configs:
        raise _invalid("a request needs at least one task and one harness config")
    trials = len(request.tasks) * len(request.harness_configs) * request.group_size
    most = limits.capacity + limits.max_queued
    if trials > most:
        raise _invalid(
            f"request asks for {trials} trials ({len(request.tasks)} tasks x {len(request.harness_configs)} harness "
            f"configs x group_size {request.group_size}); this server takes at most {most} at once "
            f"({limits.capacity} running + {limits.max_queued} queued): split the request"
        )
    for i, ref in enumerate(request.tasks):
        if not ref.task_id and not ref.location:
            raise _invalid(f"tasks[{i}]: set task_id or location")
        _check_len(f"tasks[{i}].task_id", ref.task_id, MAX_NAME_CHARS)
        _check_len(f"tasks[{i}].location", ref.location, MAX_LOCATION_CHARS)
    for i, harness in enumerate(request.harness_configs):
        _check_len(f"harness_configs[{i}].name", harness.name, MAX_NAME_CHARS)
        _check_len(f"harness_configs[{i}].config_id", harness.config_id, MAX_NAME_CHARS)
        _check_len(f"harness_configs[{i}].options_json", harness.options_json, MAX_OPTIONS_JSON_BYTES)
    if len(request.labels) > MAX_LABELS:
        raise _invalid(f"{len(request.labels)} labels; at most {MAX_LABELS}")
    for key, value in request.labels.items():
        _check_len("a label key", key, MAX_NAME_CHARS)
        _check_len(f"label {key!r}", value, MAX_LABEL_VALUE_CHARS)
    _check_limits(request.limits, limits, caps)
    _check_sampling(request.sampling, limits)


def _check_len(what: str, value: str, most: int) -> None:
    if len(value) > most:
        raise _invalid(f"{what} is {len(value)} characters long; at most {most}")


def _check_limits(trial: pb.TrialLimits, limits: ServiceLimits, caps: SessionCaps) -> None:
    for field in ("agent_timeout_s", "verifier_timeout_s"):
        value = getattr(trial, field)
        if not (math.isfinite(value) and 0 <= value <= limits.max_trial_timeout_s):
            raise _invalid(
                f"limits.{field} is {value}; it must lie in (0, {limits.max_trial_timeout_s:g}] "
                "(fleet.max_trial_timeout_s), or be 0 for the server's default"
            )
    # A request may tighten the proxy's per-session caps, never loosen them.
    for field in ("max_model_calls", "max_total_tokens"):
        value, cap = getattr(trial, field), getattr(caps, field)
        if value > cap:
            raise _invalid(f"limits.{field} is {value}; this server's cap is {cap} (proxy.{field})")


def _check_sampling(sampling: pb.SamplingParams, limits: ServiceLimits) -> None:
    if not all(math.isfinite(v) for v in (sampling.temperature, sampling.top_p)):
        raise _invalid("sampling.temperature and sampling.top_p must be finite numbers")
    if sampling.max_tokens > limits.max_tokens:
        raise _invalid(f"sampling.max_tokens is {sampling.max_tokens}; the engine's context is {limits.max_tokens}")
    if len(sampling.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise _invalid(f"{len(sampling.stop_token_ids)} sampling.stop_token_ids; at most {MAX_STOP_TOKEN_IDS}")
    try:
        sampling_config(sampling, limits.max_tokens)  # what each trial builds from it
    except ValidationError as exc:
        problems = "; ".join(f"sampling.{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        raise _invalid(problems) from None


def _parse_options(harness: pb.HarnessConfig) -> HarnessOptions:
    try:
        return get_harness(harness.name).parse_options(harness.options_json or None)
    except HarnessConfigError as exc:
        raise _invalid(str(exc)) from None
    except RecursionError:
        raise _invalid(f"{harness.name}: options_json nests too deeply") from None


class RolloutService(pb_grpc.RolloutServiceServicer):
    def __init__(
        self,
        host: TrialHost,
        engine: EngineClient,
        tasks: dict[str, Task],
        weights_root: Path,
        limits: ServiceLimits = ServiceLimits(),
        task_roots: Iterable[Path] = (),
        weights_roots: Iterable[Path] = (),
        relay_security: ClientSecurity = ClientSecurity(),
        engine_dtype: str | None = None,
        check_probe: bool = True,
        base_weights: Path | None = None,
        adapters: AdapterRoute | None = None,
    ) -> None:
        self.host = host
        # An engine that serves adapter versions by name (vLLM's LoRA path); None: it merges them on reload.
        self.adapters = adapters
        # The checkpoint the engine booted from: adapter versions apply to it until a full version replaces it.
        self.served_base = ServedBase(base_weights)
        self.engine_dtype = engine_dtype  # the engine's compute dtype (None: its own choice), for the probe
        self.check_probe = check_probe  # off only where the engine computes nothing (weight_host's)
        self.weights_root = weights_root
        # How this server calls the next one of a StreamWeights relay chain (the fleet's token and CA).
        self.relay_security = relay_security
        # The published directory the engine serves now: the base a delta must match. None until one is loaded.
        self.served_weights: Path | None = None
        # Every directory the engine may be reading: the served one or, after failed reloads, the last
        # served one and each handed over since (a reload that fails may have read any of them). Pruning
        # spares them until a load succeeds.
        self.engine_dirs: frozenset[Path] = frozenset()
        # Its tensors in host memory, so a delta patches them without reading the directory back.
        self.served_tensors = ServedTensors()
        self.engine = engine
        self.tasks = tasks
        self.limits = limits
        # Where a TaskRef.location may point: the given roots and every served task's own directory.
        self.task_roots = tuple({Path(p).resolve() for p in task_roots} | {t.root.resolve() for t in tasks.values()})
        # Where an UpdateWeights local location may point; none given, no local location is taken.
        self.weights_roots = tuple({Path(p).resolve() for p in weights_roots})
        self.draining = False
        self._slots = asyncio.Semaphore(limits.capacity)
        self._running = 0
        self._queued = 0
        self._trials: set[asyncio.Task[pb.Trajectory]] = set()
        self._cancel_reason: str | None = None
        self._weights_lock = asyncio.Lock()
        self._idle = asyncio.Event()
        self._idle.set()

    # ------------------------------------------------------------- Rollout --

    def _resolve_tasks(self, refs: Iterable[pb.TaskRef]) -> list[Task]:
        """The requested tasks, each location loaded once. Blocking (reads task directories)."""
        loaded: dict[str, Task] = {}
        out = []
        for ref in refs:
            if ref.location:
                if ref.location not in loaded:
                    loaded[ref.location] = load_task(confined_task_dir(ref.location, self.task_roots))
                out.append(loaded[ref.location])
            elif ref.task_id in self.tasks:
                out.append(self.tasks[ref.task_id])
            else:
                known = len(self.tasks)
                raise TaskError(ref.task_id, "", f"unknown task id (this server knows {known} tasks)")
        return out

    async def _specs(self, request: pb.RolloutRequest) -> list[TrialSpec]:
        """The request's trials; `Refused` when any bound is broken or any task or option is bad."""
        _check_request(request, self.limits, self.host.sessions.default_caps)
        options = [_parse_options(h) for h in request.harness_configs]
        try:
            tasks = await asyncio.to_thread(self._resolve_tasks, request.tasks)
        except TaskError as exc:
            raise _invalid(str(exc)) from None
        limits = request.limits
        agent_s = limits.agent_timeout_s or self.limits.agent_timeout_s
        verifier_s = limits.verifier_timeout_s or self.limits.verifier_timeout_s
        labels = dict(request.labels)
        base = request.sampling.seed  # 0: unseeded
        return [
            TrialSpec(
                trial_id=f"{request.request_id or 'req'}-{uuid.uuid4().hex[:10]}",
                task=task,
                harness=harness,
                options=parsed,
                sampling=request.sampling,
                limits=limits,
                labels=labels,
                agent_timeout_s=agent_s,
                verifier_timeout_s=verifier_s,
                index=index,
                seed=derive_seed(base, task_index, harness_index, index) if base else None,
            )
            for task_index, task in enumerate(tasks)
            for harness_index, (harness, parsed) in enumerate(zip(request.harness_configs, options, strict=True))
            for index in range(request.group_size)
        ]

    def _admit(self, trials: int) -> None:
        if self.draining:
            raise Refused(grpc.StatusCode.UNAVAILABLE, "server is draining")
        if self._queued + trials > self.limits.max_queued + self.limits.capacity:
            raise Refused(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{self._queued} trials already queued; at most {self.limits.max_queued} wait",
            )

    async def Rollout(
        self, request: pb.RolloutRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.Trajectory]:
        try:
            self._admit(0)
            if request.policy_version > self.host.policy_version:
                # The weights the caller expects have not arrived; a newer policy is fine
                # (each sequence records the version that sampled it; the trainer bounds lag).
                raise Refused(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"engine serves policy version {self.host.policy_version}, request wants {request.policy_version}",
                )
            specs = await self._specs(request)
            self._admit(len(specs))  # again: the state may have moved while tasks loaded
        except Refused as exc:
            await context.abort(exc.code, str(exc))
        except Exception as exc:
            await _internal(context, "Rollout", exc)
        self._queued += len(specs)
        self._idle.clear()
        pending = [asyncio.create_task(self._one(spec, request.request_id)) for spec in specs]
        self._trials.update(pending)
        try:
            # On exit, cancelled trials tear their sandboxes down before the call ends.
            async with completion_order(pending) as finished:
                for next_done in finished:
                    yield await next_done
        finally:
            self._trials.difference_update(pending)

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
        except asyncio.CancelledError:
            if self._cancel_reason is None:
                raise  # the caller went away: nobody reads this trial
            trajectory = self._ended(spec, pb.TRIAL_STATUS_CANCELLED, self._cancel_reason)
        except Exception as exc:  # a fault of this server's own: report the trial, keep the stream going
            log.exception("trial %s failed inside the rollout service", spec.trial_id)
            trajectory = self._ended(spec, pb.TRIAL_STATUS_ENV_FAILURE, f"rollout server fault: {exc!r}")
        finally:
            if not started:  # cancelled while still queued
                self._queued -= 1
            if self._running == 0 and self._queued == 0:
                self._idle.set()
        trajectory.request_id = request_id
        trajectory.trial_index = spec.index
        return trajectory

    @staticmethod
    def _ended(spec: TrialSpec, status: pb.TrialStatus, error: str) -> pb.Trajectory:
        """An ungraded trajectory for a trial that never produced its own."""
        return pb.Trajectory(
            task_id=spec.task.name,
            harness=spec.harness,
            sampling=spec.sampling,
            labels=spec.labels,
            status=status,
            error=error,
        )

    # ------------------------------------------------------------- Weights --

    @_guarded
    async def UpdateWeights(
        self, request: pb.UpdateWeightsRequest, context: grpc.aio.ServicerContext
    ) -> pb.UpdateWeightsResponse:
        if not request.location:
            raise _invalid("location is empty")
        _check_len("location", request.location, MAX_LOCATION_CHARS)
        async with self._weights_lock:
            try:
                directory = await asyncio.to_thread(
                    resolve_location,
                    request.location,
                    self.weights_root,
                    current=self.served_weights,
                    memory=self.served_tensors,
                    protect=self.engine_dirs,
                    roots=self.weights_roots,
                )
            except WeightTransferError as exc:
                raise _invalid(str(exc)) from None
            return await self._load(request.version, directory, how="from its location")

    @_guarded
    async def StreamWeights(
        self, request_iterator: AsyncIterator[pb.WeightChunk], context: grpc.aio.ServicerContext
    ) -> pb.UpdateWeightsResponse:
        async with self._weights_lock:
            idle_s = self.limits.weights_idle_timeout_s
            relay = WeightRelay(_relay_checked(request_iterator), self.relay_security, idle_timeout_s=idle_s)
            try:
                version, directory = await receive_stream(
                    relay.messages(),
                    self.weights_root,
                    idle_timeout_s=idle_s,
                    base=self.served_weights,
                    memory=self.served_tensors,
                    protect=self.engine_dirs,
                )
            except WeightStreamStalled as exc:
                await relay.finish(upstream_broken=True)
                raise Refused(grpc.StatusCode.DEADLINE_EXCEEDED, str(exc)) from None
            except WeightBaseMismatch as exc:
                # This host cannot use the delta; the hosts after it in the chain still get it.
                await relay.finish(upstream_broken=False)
                raise Refused(grpc.StatusCode.FAILED_PRECONDITION, str(exc)) from None
            except WeightTransferError as exc:
                await relay.finish(upstream_broken=False)
                raise _invalid(str(exc)) from None
            except BaseException:
                await relay.finish(upstream_broken=True)
                raise
            # The next hosts install while this one reloads; the reply waits for the whole chain.
            downstream = asyncio.create_task(relay.finish(upstream_broken=False))
            try:
                return await self._load(version, directory, how="streamed")
            finally:
                await downstream

    async def _load(self, version: int, directory: Path, *, how: str) -> pb.UpdateWeightsResponse:
        """pause (keep) → reload → reset prefix cache → label `version` → resume; new trials
        then carry `version`. Completions in flight go on under the new weights, and the
        engine's per-token versions say which of their tokens each policy sampled.
        Then the probe (`served_probe`): an engine that does not compute what the learner
        computes is restarted on the new directory (when this server launched it) and
        probed again; one that still fails is refused, and the version is not served."""
        started = time.monotonic()
        manifest = read_manifest(directory)
        adapter = manifest is not None and manifest.adapter_base is not None
        try:
            # An adapter applies to the base the engine holds, which must stay on disk beside it.
            held = {await self.served_base.check(manifest)} if adapter and manifest is not None else set()
        except WeightBaseMismatch as exc:
            raise Refused(grpc.StatusCode.FAILED_PRECONDITION, str(exc)) from None
        self.engine_dirs |= {directory}
        try:
            if adapter and self.adapters is not None:
                probe, path = await self._serve_adapter(self.adapters, version, directory)
            else:
                await self.engine.update_weights(str(directory), "keep", version=str(version))
                probe, path = await self._probe_or_restart(directory)
        except (EngineError, ProbeFailed) as exc:
            # What the engine holds now is unknown: no delta may build on it, and no directory it was
            # handed may be pruned (`engine_dirs` keeps them all).
            self.served_weights = None
            self.served_tensors.clear()
            if not adapter:
                self.served_base.directory = None
            raise Refused(grpc.StatusCode.INTERNAL, f"engine reload of {directory} failed: {exc}") from None
        self.host.policy_version = version
        self.served_weights = directory
        self.engine_dirs = frozenset({directory, *held})
        if not adapter:
            self.served_base.directory = directory
        reload_s = time.monotonic() - started
        diff = math.nan if probe is None else probe.max_abs_diff
        log.info("policy version %d loaded (%s) by %s in %.2f s; probe max diff %.3g", version, how, path,
                 reload_s, diff)  # fmt: skip
        return pb.UpdateWeightsResponse(loaded_version=version, reload_s=reload_s, probe_max_abs_diff=diff,
                                        update_path=path)  # fmt: skip

    async def _serve_adapter(
        self, adapters: AdapterRoute, version: int, directory: Path
    ) -> tuple[ProbeResult | None, str]:
        """Loads the adapter under its own name and probes through it; new requests name it only once
        it passed, while requests in flight finish on the adapter they named (`AdapterRoute`)."""
        watch = self.engine.watch
        epoch = 0 if watch is None else watch.epoch()
        loaded = await adapters.load(self.engine, version, directory)
        probe = None
        if self.check_probe:
            probe = await probe_engine(self.engine, directory, self.engine_dtype, model=loaded.name)
        if probe is not None and not probe.passed:
            raise ProbeFailed(failure(probe, directory, "serving the adapter"))
        # A restart comes back on the base with this adapter (`vllm_plan`), unless one came meanwhile.
        if watch is not None and not watch.record(epoch, str(directory), str(version)):
            raise EngineError(0, f"the engine restarted while loading {directory}", "EngineRestarted")
        await adapters.serve(self.engine, loaded)
        return probe, "adapter"

    async def _probe_or_restart(self, directory: Path) -> tuple[ProbeResult | None, str]:
        """The probe of what the engine now serves, and how it came to serve it ("reload" or "restart")."""
        if not self.check_probe:
            return None, "reload"
        result = await probe_engine(self.engine, directory, self.engine_dtype)
        if result is None or result.passed:
            return result, "reload"
        watch = self.engine.watch
        if watch is None:
            raise ProbeFailed(failure(result, directory, "reloaded with"))
        log.error("%s; restarting it on them", failure(result, directory, "reloaded with"))
        epoch = watch.epoch()
        watch.restart(f"reload of {directory} failed its probe")
        await self.engine.wait_for_restart(epoch, self.limits.engine_restart_timeout_s)
        result = await probe_engine(self.engine, directory, self.engine_dtype)
        if result is not None and not result.passed:
            raise ProbeFailed(failure(result, directory, "restarted on"))
        return result, "restart"

    # -------------------------------------------------------------- Status --

    @_guarded
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

    # --------------------------------------------------------------- Drain --

    async def drain(self, grace_s: float) -> bool:
        """Refuses new work and waits for in-flight trials; True when all finished in time."""
        self.draining = True
        try:
            await asyncio.wait_for(self._idle.wait(), grace_s)
            return True
        except TimeoutError:
            return False

    async def cancel_trials(self, reason: str, wait_s: float = CANCEL_WAIT_S) -> bool:
        """Cancels every trial; each streams out as a CANCELLED trajectory saying `reason`.
        Waits up to `wait_s` for their teardown; True when all ended in time."""
        self._cancel_reason = reason
        trials = list(self._trials)
        for task in trials:
            task.cancel()
        if not trials:
            return True
        _, still = await asyncio.wait(trials, timeout=wait_s)
        return not still
