"""`legorl serve` as a supervised subprocess: the embedded JAX engine launched
exactly as vLLM is, for CPU hosts and for an out-of-process default."""

from __future__ import annotations

import sys
from pathlib import Path

from legorl_jax.config import EngineConfig
from rollout_server.backends.supervisor import LaunchPlan
from rollout_server.backends.vllm import NATIVE_RELOAD_METHOD, free_port


def embedded_plan(engine: EngineConfig, model_dir: str | Path, served_model_name: str | None = None) -> LaunchPlan:
    port = engine.port or free_port(engine.host)
    command = [
        sys.executable, "-m", "legorl_jax.cli", "serve",
        "--model", str(model_dir),
        "--host", engine.host,
        "--port", str(port),
        "--max-model-len", str(engine.max_context),
        "--max-num-seqs", str(engine.max_batch),
        "--return-tokens-as-token-ids",
    ]  # fmt: skip
    if served_model_name is not None:
        command += ["--served-model-name", served_model_name]
    return LaunchPlan(command=command, env={}, url=f"http://{engine.host}:{port}", reload_method=NATIVE_RELOAD_METHOD)
