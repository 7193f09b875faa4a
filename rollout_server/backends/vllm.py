"""`vllm serve` on GPU rollout hosts: the command line the project needs and
a supervised process behind the shared `EngineClient`.

Flags and why:
- `--logprobs-mode processed_logprobs`: logprobs after temperature (and
  top-k/top-p), the distribution tokens were sampled from: raw logprobs would
  make the importance ratio wrong whenever the temperature is not 1.
- `--return-tokens-as-token-ids`: logprob tokens read `token_id:<n>`, so ids
  survive even where `token_ids` is missing: re-tokenizing text never gives
  back the sampled ids.
- `--generation-config vllm`: the checkpoint's generation_config.json must not
  silently change sampling defaults (top-p / top-k bias the IS ratio).
- `VLLM_SERVER_DEV_MODE=1`: serves /pause, /resume, /collective_rpc and
  /reset_prefix_cache, the weight-reload calls.
- `--worker-extension-cls`: adds `reload_weights_from_path` to every worker,
  for vLLM versions whose `reload_weights` cannot take a directory.
"""

from __future__ import annotations

import dataclasses
import shutil
import socket
from pathlib import Path

from legorl_jax.config import EngineConfig
from rollout_server.backends.supervisor import LaunchPlan

WORKER_EXTENSION = "rollout_server.backends.vllm_worker.PathReloadExtension"
EXTENSION_RELOAD_METHOD = "reload_weights_from_path"
NATIVE_RELOAD_METHOD = "reload_weights"


@dataclasses.dataclass(frozen=True)
class VllmOptions:
    executable: str = "vllm"
    use_worker_extension: bool = True
    served_model_name: str | None = None


def free_port(host: str) -> int:
    """A port nothing listens on right now (for subprocess servers, which
    cannot report a port-0 choice back)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def vllm_plan(engine: EngineConfig, model_dir: str | Path, options: VllmOptions = VllmOptions()) -> LaunchPlan:
    if shutil.which(options.executable) is None:
        raise FileNotFoundError(f"`{options.executable}` not found on PATH; install the vllm extra on GPU hosts")
    port = engine.port or free_port(engine.host)
    command = [
        options.executable, "serve", str(model_dir),
        "--host", engine.host,
        "--port", str(port),
        "--served-model-name", options.served_model_name or str(model_dir),
        "--max-model-len", str(engine.max_context),
        "--max-num-seqs", str(engine.max_batch),
        "--logprobs-mode", "processed_logprobs",
        "--return-tokens-as-token-ids",
        "--generation-config", "vllm",
    ]  # fmt: skip
    if options.use_worker_extension:
        command += ["--worker-extension-cls", WORKER_EXTENSION]
    command += engine.extra_args
    return LaunchPlan(
        command=command,
        env={"VLLM_SERVER_DEV_MODE": "1"},
        url=f"http://{engine.host}:{port}",
        reload_method=EXTENSION_RELOAD_METHOD if options.use_worker_extension else NATIVE_RELOAD_METHOD,
    )
