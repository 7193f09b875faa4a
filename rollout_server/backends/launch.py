"""Chooses and runs the inference engine an `EngineConfig` names, and hands out
clients for it: `vllm` (supervised `vllm serve`), `embedded` (supervised
`legorl serve`), or `external` (a URL someone else runs).

A launched engine remembers the weights last installed through its clients;
after a crash it comes back serving them, and its epoch (one per restart)
tells trials that an engine they used went away under them."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from legorl_jax.core.config import CHAT_ENGINE_KINDS, EngineConfig
from rollout_server.backends.adapters import installed_adapter
from rollout_server.backends.client import EngineClient, SyncEngineClient, TokenRoute
from rollout_server.backends.embedded import embedded_plan
from rollout_server.backends.served_probe import ProbeFailed, failure, probe_engine
from rollout_server.backends.supervisor import LaunchPlan, ProcessSupervisor
from rollout_server.backends.vllm import (
    RELOAD_METHOD,
    VllmOptions,
    check_vllm_version,
    free_port,
    token_route,
    vllm_plan,
    with_cpu_defaults,
)

log = logging.getLogger(__name__)

# (weights directory to serve, or None for the model directory) -> the command that serves it
Planner = Callable[[str | None], LaunchPlan]


class ManagedEngine:
    """An engine URL plus, when this process launched it, its supervisor and
    the weights it serves (the `EngineWatch` its clients report to)."""

    def __init__(
        self,
        url: str,
        *,
        unit_temperature_prompt_logprobs: bool,
        installed: str | None = None,
        dtype: str | None = None,
        reload_method: str = "reload_weights",
        token_route: TokenRoute = "completions",
        adapters_by_name: bool = False,
    ) -> None:
        self.url = url.rstrip("/")
        # A vLLM with --enable-lora: adapter versions are served by name (`adapters.AdapterRoute`).
        self.adapters_by_name = adapters_by_name
        self.reload_method = reload_method
        self.token_route = token_route
        self.supervisor: ProcessSupervisor | None = None
        self.unit_temperature_prompt_logprobs = unit_temperature_prompt_logprobs
        self.dtype = dtype  # the engine's compute dtype, None where it chooses (the probe's tolerance)
        self._installed = installed
        self._label: str | None = None
        self._epoch = 0
        self._lock = threading.Lock()  # the supervisor's thread replans while clients record

    @classmethod
    def launch(
        cls,
        planner: Planner,
        model_dir: str | Path,
        *,
        unit_temperature_prompt_logprobs: bool,
        dtype: str | None = None,
        reload_method: str = "reload_weights",
        token_route: TokenRoute = "completions",
        adapters_by_name: bool = False,
        **supervisor_kwargs: Any,
    ) -> ManagedEngine:
        plan = planner(None)
        engine = cls(
            plan.url,
            unit_temperature_prompt_logprobs=unit_temperature_prompt_logprobs,
            installed=str(model_dir),
            dtype=dtype,
            reload_method=reload_method,
            token_route=token_route,
            adapters_by_name=adapters_by_name,
        )
        engine.supervisor = ProcessSupervisor(
            plan, replan=lambda: engine._replan(planner), after_restart=engine._after_restart, **supervisor_kwargs
        )
        engine.supervisor.start()
        return engine

    def _replan(self, planner: Planner) -> LaunchPlan:
        with self._lock:
            self._epoch += 1
            weights = self._installed
        log.warning("engine restart %d serves %s", self._epoch, weights)
        return planner(weights)

    def _after_restart(self) -> None:
        """A restarted engine gets back its weights' label, and must pass their probe
        before it counts as up (raising: the supervisor kills it and tries again)."""
        with self._lock:
            weights, label = self._installed, self._label
        sync = SyncEngineClient(self.url, unit_temperature_prompt_logprobs=self.unit_temperature_prompt_logprobs)
        try:
            if label is not None:
                sync.label_weights(label)
            if weights is not None:
                adapter = installed_adapter(weights) if self.adapters_by_name else None
                model = None if adapter is None else adapter.name
                result = sync.run(probe_engine(sync.async_client, weights, self.dtype, model=model))
                if result is not None and not result.passed:
                    raise ProbeFailed(failure(result, weights, "restarted on"))
                if result is not None:
                    log.info("restarted engine passes the probe of %s (max diff %.3g)", weights, result.max_abs_diff)
        finally:
            sync.close()

    # -- EngineWatch ------------------------------------------------------------
    def epoch(self) -> int:
        with self._lock:
            return self._epoch

    def installed(self) -> str | None:
        with self._lock:
            return self._installed

    def record(self, epoch: int, weights_path: str, label: str | None = None) -> bool:
        with self._lock:
            if epoch != self._epoch:
                return False
            self._installed = weights_path
            self._label = label
            return True

    def state(self) -> str:
        return "healthy" if self.supervisor is None else self.supervisor.state

    def restart(self, reason: str) -> None:
        """A planned restart: the engine is alive but not on the weights it should serve."""
        log.error("restarting the engine: %s", reason)
        if self.supervisor is not None:
            self.supervisor.kill(planned=True)

    # ---------------------------------------------------------------------------
    def _client_kwargs(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        watch = self if self.supervisor is not None else None
        return {
            "watch": watch,
            "unit_temperature_prompt_logprobs": self.unit_temperature_prompt_logprobs,
            "reload_method": self.reload_method,
            "token_route": self.token_route,
            **kwargs,
        }

    def client(self, **kwargs: Any) -> EngineClient:
        return EngineClient(self.url, **self._client_kwargs(kwargs))

    def sync_client(self, **kwargs: Any) -> SyncEngineClient:
        return SyncEngineClient(self.url, **self._client_kwargs(kwargs))

    def stop(self) -> None:
        if self.supervisor is not None:
            self.supervisor.stop()


def start_engine(
    engine: EngineConfig,
    model_dir: str | Path | None = None,
    vllm: VllmOptions | None = None,
    **supervisor_kwargs: Any,
) -> ManagedEngine:
    """Launches (or, for `external`, points at) the engine. vLLM computes prompt
    logprobs at temperature 1; an external engine is assumed to be vLLM."""
    vllm = vllm or VllmOptions()
    if engine.kind in CHAT_ENGINE_KINDS:  # else it would be taken for one to launch
        raise ValueError(
            f"engine.kind={engine.kind} is a chat teacher, nothing to launch: the rollout server's proxy calls it"
        )
    if engine.kind == "external":
        if not engine.url:
            raise ValueError("engine.kind=external needs engine.url")
        return ManagedEngine(engine.url, unit_temperature_prompt_logprobs=True)
    if model_dir is None:
        raise ValueError(f"engine.kind={engine.kind} needs a model directory to serve")
    # One port for the engine's whole life: restarts must come back where clients look.
    fixed = engine.model_copy(update={"port": engine.port or free_port(engine.host)})
    route: TokenRoute = "completions"
    if engine.kind == "vllm":
        version = check_vllm_version(vllm.executable)
        fixed = with_cpu_defaults(fixed, version)
        route = token_route(version)

        def planner(weights: str | None) -> LaunchPlan:
            return vllm_plan(fixed, model_dir, vllm, weights_dir=weights, route=route)
    else:

        def planner(weights: str | None) -> LaunchPlan:
            return embedded_plan(fixed, model_dir, str(model_dir), weights_dir=weights)

    return ManagedEngine.launch(
        planner,
        model_dir,
        unit_temperature_prompt_logprobs=engine.kind == "vllm",
        dtype=engine.dtype or ("float32" if engine.kind == "embedded" else None),
        reload_method=RELOAD_METHOD if engine.kind == "vllm" else "reload_weights",
        token_route=route,
        adapters_by_name=engine.kind == "vllm" and "--enable-lora" in engine.extra_args,
        **supervisor_kwargs,
    )
