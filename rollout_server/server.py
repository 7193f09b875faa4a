"""One rollout host: the inference engine, the token-capture proxy, the
sandbox factory and the gRPC `RolloutService`, started and stopped together.

The proxy runs in this process (its session store is shared with the trial
runner) and listens on loopback for in-process harnesses and, with Docker's
proxy-only network, on that network's gateway for harnesses in containers.

The gRPC endpoint runs trials (code in sandboxes) and replaces the policy, so
it listens on loopback unless told otherwise, and refuses any other address
without a bearer token. A request's `TaskRef.location` must lie under the
server's task roots.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import ipaddress
import logging
import signal
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, cast

import grpc
import uvicorn

from legorl_jax.core import log_redaction
from legorl_jax.core.config import CHAT_ENGINE_KINDS, Config, ConfigError, EngineConfig
from legorl_jax.core.grpc_auth import SERVER_KEEPALIVE_OPTIONS, client_security, server_security
from protos.legorl.v1 import rollout_pb2_grpc as pb_grpc
from rollout_server.backends.client import EngineClient, EngineError
from rollout_server.backends.launch import ManagedEngine, start_engine
from rollout_server.demo_families import all_demo_tasks, default_cache_root
from rollout_server.harnesses.tools import HarnessTools
from rollout_server.proxy.app import build_app
from rollout_server.proxy.engine_client import ProxyEngineClient
from rollout_server.proxy.service import build_core
from rollout_server.sandbox.factory import SandboxFactory
from rollout_server.service import RolloutService, ServiceLimits
from rollout_server.tasks import DEMO_TASKS_DIR, Task, load_tasks
from rollout_server.trial import TrialHost

if TYPE_CHECKING:  # the providers' SDKs load only where a chat teacher is the engine
    from rollout_server.proxy.chat_teacher import ChatTeacher

log = logging.getLogger(__name__)

# Seconds the proxy waits for model calls still open at shutdown (their trials are gone by then);
# whole seconds, as uvicorn takes them.
_PROXY_SHUTDOWN_S = 5


class _ProxyServer(uvicorn.Server):
    """The proxy's uvicorn, leaving signals to the process that embeds it (`serve_forever`,
    `legorl train`): uvicorn's own handlers would close the proxy at the first SIGTERM while
    the trials it serves still drain, and raise the signal again once it has stopped."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _bind(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(512)
    sock.setblocking(False)
    return sock


def server_tasks(config: Config) -> dict[str, Task]:
    tasks = load_tasks([*config.tasks.train, *config.tasks.eval])
    if config.tasks.demo:
        tasks.extend(all_demo_tasks(config.tasks.demo_variants))
    return {task.name: task for task in tasks}


def task_roots(config: Config) -> list[Path]:
    """Directories a request's TaskRef.location may point into: the configured roots, the train/eval
    directories, the shipped demo tasks and the generated demo-task cache."""
    sources = [Path(p) for p in (*config.tasks.train, *config.tasks.eval)]
    return [
        *(Path(p) for p in config.tasks.location_roots),
        *(p for p in sources if p.is_dir()),
        DEMO_TASKS_DIR,
        default_cache_root(),
    ]


def weights_roots(config: Config) -> list[Path]:
    """Directories an UpdateWeights local location may point into: the configured roots, the run
    directory the learner publishes under (logging.run_dir) and fleet.weights_dir when it is local."""
    local = config.fleet.weights_dir if config.fleet.weights_dir and "://" not in config.fleet.weights_dir else None
    return [
        *(Path(p) for p in config.fleet.weights_location_roots),
        Path(config.logging.run_dir),
        *([Path(local)] if local else []),
    ]


def is_loopback(address: str) -> bool:
    """Whether a gRPC listen address (host:port, [v6]:port, unix:path) is reachable only from this host."""
    if address.startswith(("unix:", "unix-abstract:")):
        return True
    host = address.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name other than localhost, or empty (every interface)
        return False


async def served_model_and_context(engine: EngineClient, cfg: EngineConfig) -> tuple[str, int]:
    """The model id and context the engine serves, read from the engine once it answers, waiting
    at most engine.startup_timeout_s: an engine started elsewhere may serve another context than
    the config's max_context, and the proxy must hold prompts to the engine's."""
    try:
        await engine.wait_healthy(timeout=cfg.startup_timeout_s)
    except EngineError as exc:
        raise EngineError(
            0,
            f"the engine (engine.kind {cfg.kind}) at {engine.base_url} was not healthy within "
            f"engine.startup_timeout_s={cfg.startup_timeout_s:g} s: start it, or give it longer",
            "Timeout",
        ) from exc
    served, context = await engine.model(), await engine.served_context()
    if cfg.max_context is not None and context != cfg.max_context:
        log.info(
            "engine %s serves a context of %d tokens (engine.max_context, %d, applies to launched engines)",
            engine.base_url,
            context,
            cfg.max_context,
        )
    return served, context


class RolloutServer:
    """`await start()` brings every part up (engine first); `await stop()` drains and tears down."""

    def __init__(
        self, config: Config, model_dir: str | Path, *, address: str = "127.0.0.1:0", insecure_no_auth: bool = False
    ) -> None:
        log_redaction.install()  # its proxy's session keys are in URLs its harnesses' clients log
        self.config = config
        self.model_dir = Path(model_dir)
        self.address = address
        # Listen on a non-loopback address without a token: only for a network nobody else can reach.
        self.insecure_no_auth = insecure_no_auth
        self.engine: ManagedEngine | None = None
        self.service: RolloutService | None = None
        self._grpc: grpc.aio.Server | None = None
        self._proxy: _ProxyServer | None = None
        self._proxy_task: asyncio.Task[None] | None = None
        self._factory: SandboxFactory | None = None
        self._clients: list[EngineClient | ProxyEngineClient | ChatTeacher] = []
        self._weights_dir: tempfile.TemporaryDirectory[str] | None = None
        self._tools: HarnessTools | None = None

    async def start(self) -> str:
        """Returns the gRPC address the server listens on."""
        cfg = self.config
        security = server_security(cfg.fleet.security)  # before the engine: a bad secret fails in a second
        if not security.interceptors and not is_loopback(self.address) and not self.insecure_no_auth:
            raise ConfigError(
                f"refusing to listen on {self.address} without a bearer token: anyone who reaches it can run code "
                "in sandboxes and replace the weights. Set fleet.security.token_env or fleet.security.token_file, "
                "listen on 127.0.0.1 (--address), or pass --insecure-no-auth on a network only you can reach"
            )
        tasks = server_tasks(cfg)
        self._tools = HarnessTools.from_config(cfg.sandbox.harness_tools)  # a bad path fails before the engine starts
        if cfg.engine.kind in CHAT_ENGINE_KINDS:
            from rollout_server.proxy.chat_teacher import TeacherEngine, chat_teacher, teacher_context

            teacher = chat_teacher(cfg.engine)  # a key named but unset fails here
            # The service's engine: no weights to update, no epochs; the proxy calls the teacher itself.
            engine = cast(EngineClient, TeacherEngine(teacher))
            served, context = teacher.model, teacher_context(cfg.engine, self.model_dir)
            proxied: str | ChatTeacher = teacher
        else:
            engine, served, context = await self._launch()
            proxied = engine.base_url

        loopback = _bind(cfg.proxy.host, cfg.proxy.port)
        proxy_port = loopback.getsockname()[1]
        self._factory = await asyncio.to_thread(
            SandboxFactory,
            cfg.sandbox.kind,
            cfg.sandbox.network,
            proxy_port=proxy_port,
            allow_local_fallback=cfg.sandbox.allow_local_fallback,
            unenforceable_storage=cfg.sandbox.unenforceable_storage,
        )
        sockets = [loopback]
        if self._factory.network is not None:
            sockets.append(_bind(self._factory.network.gateway, proxy_port))

        core = build_core(
            self.model_dir,
            proxied,
            served_model=served,
            max_context=context,
            config=cfg.proxy,
            unit_temperature_prompt_logprobs=engine.unit_temperature_prompt_logprobs,
            token_route=engine.token_route,
        )
        self._clients.append(core.engine)
        app = build_app(core, keepalive_s=cfg.proxy.keepalive_s, max_request_bytes=cfg.proxy.max_request_bytes)
        self._proxy = _ProxyServer(
            uvicorn.Config(app, log_level="warning", lifespan="off", timeout_graceful_shutdown=_PROXY_SHUTDOWN_S)
        )
        self._proxy_task = asyncio.create_task(self._proxy.serve(sockets=sockets))

        host = TrialHost(
            self._factory,
            core.store,
            proxy_port,
            core.model_name,
            policy_version=0,
            engine_healthy=engine.healthy,
            engine_epoch=None if self.engine is None else self.engine.epoch,
            harness_tools=self._tools,
        )
        limits = ServiceLimits(
            capacity=cfg.fleet.capacity_per_server,
            max_queued=cfg.fleet.max_queued_per_server,
            agent_timeout_s=cfg.fleet.agent_timeout_s,
            verifier_timeout_s=cfg.fleet.verifier_timeout_s,
            max_trial_timeout_s=cfg.fleet.max_trial_timeout_s,
            max_tokens=context,
            weights_idle_timeout_s=cfg.fleet.weights_idle_timeout_s,
            engine_restart_timeout_s=cfg.engine.startup_timeout_s,
        )
        adapters = None  # a vLLM with LoRA serves adapter versions by name, which the proxy's requests give
        if isinstance(core.engine, ProxyEngineClient) and self.engine is not None and self.engine.adapters_by_name:
            adapters = core.engine.adapters
        self._weights_dir = tempfile.TemporaryDirectory(prefix="legorl-weights-")
        self.service = RolloutService(
            host,
            engine,
            tasks,
            Path(self._weights_dir.name),
            limits,
            task_roots=task_roots(cfg),
            weights_roots=weights_roots(cfg),
            # A relayed weight stream goes to another server of the fleet, which wants the fleet's token and TLS.
            relay_security=client_security(cfg.fleet.security),
            engine_dtype=None if self.engine is None else self.engine.dtype,
            base_weights=self.model_dir,
            adapters=adapters,
        )
        # Streamed weights carry tokenizer files whole in their header (Qwen3's is ~11 MB).
        self._grpc = grpc.aio.server(
            interceptors=security.interceptors,
            options=[("grpc.max_receive_message_length", 64 * 2**20), *SERVER_KEEPALIVE_OPTIONS],
        )
        pb_grpc.add_RolloutServiceServicer_to_server(self.service, self._grpc)
        if security.credentials is None:
            port = self._grpc.add_insecure_port(self.address)
        else:
            port = self._grpc.add_secure_port(self.address, security.credentials)
        if port == 0:
            raise OSError(f"cannot listen on {self.address}")
        await self._grpc.start()
        self.address = f"{self.address.rsplit(':', 1)[0]}:{port}"
        log.info(
            "rollout server on %s (%s): engine %s (%s), proxy port %d, %s sandboxes, %d tasks",
            self.address,
            security.describe(),
            engine.base_url,
            served,
            proxy_port,
            self._factory.kind,
            len(tasks),
        )
        return self.address

    async def _launch(self) -> tuple[EngineClient, str, int]:
        """Starts (or, for `external`, points at) the engine; its client, served model and context."""
        cfg = self.config.engine
        launch = asyncio.ensure_future(
            asyncio.to_thread(start_engine, cfg, self.model_dir, health_timeout=cfg.startup_timeout_s)
        )
        try:
            self.engine = await asyncio.shield(launch)
        except asyncio.CancelledError:
            # The launching thread runs on until the engine is up (or failed): keep what it
            # started, so that stop() stops it rather than leaving an engine nobody owns.
            with contextlib.suppress(Exception):
                self.engine = await launch
            raise
        engine = self.engine.client()
        self._clients.append(engine)
        served, context = await served_model_and_context(engine, cfg)
        await engine.label_weights("0")  # the policy version its tokens carry until the first UpdateWeights
        self.engine.record(self.engine.epoch(), str(self.model_dir), "0")  # and again after a restart before then
        return engine, served, context

    async def stop(self, grace_s: float = 60.0) -> None:
        """Drains for at most `grace_s`, cancels the trials still running (they stream out as CANCELLED),
        then tears every part down. Every wait is bounded, so a trial or a model call that would run for
        minutes cannot hold the shutdown up."""
        if self.service is not None and not await self.service.drain(grace_s):
            log.warning("drain: trials still running after %.0fs; cancelling them", grace_s)
            if not await self.service.cancel_trials(f"cancelled: the rollout server shut down ({grace_s:g} s grace)"):
                log.warning("drain: cancelled trials did not all end in time; stopping anyway")
        if self._grpc is not None:
            await self._grpc.stop(grace=5.0)
        if self._proxy is not None and self._proxy_task is not None:
            self._proxy.should_exit = True
            await self._proxy_task
        for client in self._clients:
            await client.aclose()
        if self._factory is not None:
            self._factory.close()
        if self.engine is not None:
            await asyncio.to_thread(self.engine.stop)
        if self._weights_dir is not None:
            self._weights_dir.cleanup()
        if self._tools is not None:
            self._tools.close()

    async def serve_forever(self, grace_s: float = 300.0) -> None:
        """Runs until SIGTERM or SIGINT, then drains: in-flight trials finish or are reported."""
        await self.start()
        # Start-up objects (tokenizer, templates, engine, tasks) live as long as the server; frozen,
        # a full collection no longer walks them (each one stalled every session; docs/benchmarks.md, Proxy).
        gc.freeze()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        try:
            await stop.wait()
        finally:
            await self.stop(grace_s)
