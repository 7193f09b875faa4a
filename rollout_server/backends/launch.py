"""Chooses and runs the inference engine an `EngineConfig` names, and hands out
clients for it: `vllm` (supervised `vllm serve`), `embedded` (supervised
`legorl serve`), or `external` (a URL someone else runs)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from legorl_jax.config import EngineConfig
from rollout_server.backends.client import EngineClient, SyncEngineClient
from rollout_server.backends.embedded import embedded_plan
from rollout_server.backends.supervisor import LaunchPlan, ProcessSupervisor
from rollout_server.backends.vllm import NATIVE_RELOAD_METHOD, VllmOptions, vllm_plan


class ManagedEngine:
    """An engine URL plus, when this process launched it, its supervisor."""

    def __init__(self, url: str, reload_method: str, supervisor: ProcessSupervisor | None = None) -> None:
        self.url = url.rstrip("/")
        self.reload_method = reload_method
        self.supervisor = supervisor

    @classmethod
    def launch(cls, plan: LaunchPlan, **supervisor_kwargs: Any) -> ManagedEngine:
        supervisor = ProcessSupervisor(plan, **supervisor_kwargs)
        supervisor.start()
        return cls(plan.url, plan.reload_method, supervisor)

    def client(self, **kwargs: Any) -> EngineClient:
        return EngineClient(self.url, reload_method=self.reload_method, **kwargs)

    def sync_client(self, **kwargs: Any) -> SyncEngineClient:
        return SyncEngineClient(self.url, reload_method=self.reload_method, **kwargs)

    def stop(self) -> None:
        if self.supervisor is not None:
            self.supervisor.stop()


def start_engine(
    engine: EngineConfig, model_dir: str | Path | None = None, vllm: VllmOptions = VllmOptions(), **supervisor_kwargs: Any
) -> ManagedEngine:
    if engine.kind == "external":
        if not engine.url:
            raise ValueError("engine.kind=external needs engine.url")
        return ManagedEngine(engine.url, NATIVE_RELOAD_METHOD)
    if model_dir is None:
        raise ValueError(f"engine.kind={engine.kind} needs a model directory to serve")
    plan = vllm_plan(engine, model_dir, vllm) if engine.kind == "vllm" else embedded_plan(engine, model_dir)
    return ManagedEngine.launch(plan, **supervisor_kwargs)
