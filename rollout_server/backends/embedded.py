"""`legorl serve` as a supervised subprocess: the embedded JAX engine launched
exactly as vLLM is, for CPU hosts and for an out-of-process default."""

from __future__ import annotations

import sys
from pathlib import Path

from legorl_jax.core.config import EngineConfig
from legorl_jax.core.weight_layout import ADAPTER_CONFIG_FILE
from rollout_server.backends.supervisor import LaunchPlan
from rollout_server.backends.vllm import free_port


def embedded_plan(
    engine: EngineConfig,
    model_dir: str | Path,
    served_model_name: str | None = None,
    weights_dir: str | Path | None = None,
) -> LaunchPlan:
    """Serves `weights_dir` (default: `model_dir`); published weights directories
    carry the tokenizer, so `legorl serve` needs no separate one. An adapter version
    (a LoRA run's) is served merged onto `model_dir`, the base it was trained on."""
    port = engine.port or free_port(engine.host)
    adapter = weights_dir is not None and (Path(weights_dir) / ADAPTER_CONFIG_FILE).is_file()
    command = [
        sys.executable, "-m", "legorl_jax.cli", "serve",
        "--model", str(model_dir if adapter else weights_dir or model_dir),
        "--host", engine.host,
        "--port", str(port),
        "--max-num-seqs", str(engine.max_batch),
        "--max-chunk", str(engine.max_chunk),
        "--kv-cache-dtype", engine.kv_cache_dtype,
        "--return-tokens-as-token-ids",
        "--enable-prefix-caching" if engine.enable_prefix_caching else "--no-enable-prefix-caching",
    ]  # fmt: skip
    if engine.max_context is not None:
        command += ["--max-model-len", str(engine.max_context)]
    if engine.dtype is not None:
        command += ["--dtype", engine.dtype]
    if engine.kv_cache_memory_bytes is not None:
        command += ["--kv-cache-memory-bytes", str(engine.kv_cache_memory_bytes)]
    if adapter:
        command += ["--lora-adapter", str(weights_dir)]
    if served_model_name is not None:
        command += ["--served-model-name", served_model_name]
    return LaunchPlan(command=command, env={}, url=f"http://{engine.host}:{port}")
