"""`vllm serve` on GPU rollout hosts: the supported vLLM range, the command
line the project needs, and a check of the installed version before launch.

Flags and why:
- `--logprobs-mode processed_logprobs`: logprobs after temperature (and
  top-k/top-p), the distribution tokens were sampled from: raw logprobs would
  make the importance ratio wrong whenever the temperature is not 1.
- `--return-tokens-as-token-ids`: logprob tokens read `token_id:<n>`, so ids
  survive even where `token_ids` is missing: re-tokenizing text never gives
  back the sampled ids.
- `--generation-config vllm`: the checkpoint's generation_config.json must not
  silently change sampling defaults (top-p / top-k bias the IS ratio).
- `--seed`: vLLM seeds unseeded requests from one global seed, 0 by default,
  so every host would sample the same sequence; each launch draws its own.
- `--tokenizer`: the base model's, so a restart can serve a weights
  directory that carries no tokenizer of its own.
- the engine section's launch options, as vLLM's flags of the same meaning
  (`engine_flags`; each exists in 0.17.0 and 0.33.0, `vllm/engine/arg_utils.py`);
  `max_chunk` has none and the config refuses it for vLLM.
- `VLLM_SERVER_DEV_MODE=1`: serves /pause, /resume, /collective_rpc and
  /reset_prefix_cache, the weight-update calls. Weights reload through the
  worker's own `reload_weights(weights_path=…)`, which runs vLLM's post-load
  processing (every version in the range has it).
"""

from __future__ import annotations

import dataclasses
import secrets
import shutil
import socket
import subprocess
from pathlib import Path

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from legorl_jax.core.config import EngineConfig
from rollout_server.backends.supervisor import LaunchPlan

# Kept equal to the `vllm` extra in pyproject.toml (a test compares them).
# Below 0.17: no /pause (0.11), keep mode aborting requests (0.14-0.15), or a
# prefix-cache reset that fails silently with requests in flight (0.16).
SUPPORTED_VLLM = SpecifierSet(">=0.17,<0.34")


class VllmVersionError(RuntimeError):
    """The installed vLLM is missing or outside SUPPORTED_VLLM."""


@dataclasses.dataclass(frozen=True)
class VllmOptions:
    executable: str = "vllm"
    served_model_name: str | None = None
    seed: int | None = None  # None: a random seed per launch, so no two hosts share one


def free_port(host: str) -> int:
    """A port nothing listens on right now (for subprocess servers, which
    cannot report a port-0 choice back)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def check_vllm_version(executable: str = "vllm", timeout_s: float = 300.0) -> Version:
    """The version `vllm --version` reports, if SUPPORTED_VLLM contains it;
    otherwise a VllmVersionError that says what is installed and what to install."""
    path = shutil.which(executable)
    if path is None:
        raise VllmVersionError(f"`{executable}` not found on PATH; install the vllm extra on GPU hosts")
    try:
        proc = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise VllmVersionError(f"`{path} --version` failed: {exc}") from None
    lines = proc.stdout.strip().splitlines()
    try:
        version = Version(lines[-1].strip())
    except (IndexError, InvalidVersion):
        raise VllmVersionError(
            f"`{path} --version` exited {proc.returncode} without a version: {(proc.stdout + proc.stderr)[-500:]!r}"
        ) from None
    if version not in SUPPORTED_VLLM:
        raise VllmVersionError(
            f"vLLM {version} at {path} is outside the supported range {SUPPORTED_VLLM}; "
            f"install it with `pip install 'vllm{SUPPORTED_VLLM}'` (docs/scale-out.md says why)"
        )
    return version


def engine_flags(engine: EngineConfig) -> list[str]:
    """vLLM's flags for the engine section's launch options: the prefix-cache
    switch always; dtype, KV dtype and pool size when set (else vLLM chooses)."""
    flags = ["--enable-prefix-caching" if engine.enable_prefix_caching else "--no-enable-prefix-caching"]
    if engine.dtype is not None:
        flags += ["--dtype", engine.dtype]
    if engine.kv_cache_dtype != "auto":
        flags += ["--kv-cache-dtype", engine.kv_cache_dtype]
    if engine.kv_cache_memory_bytes is not None:
        flags += ["--kv-cache-memory-bytes", str(engine.kv_cache_memory_bytes)]
    return flags


def vllm_plan(
    engine: EngineConfig,
    model_dir: str | Path,
    options: VllmOptions = VllmOptions(),
    weights_dir: str | Path | None = None,
) -> LaunchPlan:
    """The command serving `weights_dir` (default: `model_dir`) under the name and
    tokenizer of `model_dir`; each call draws a new seed unless one is configured."""
    if shutil.which(options.executable) is None:
        raise FileNotFoundError(f"`{options.executable}` not found on PATH; install the vllm extra on GPU hosts")
    port = engine.port or free_port(engine.host)
    seed = options.seed if options.seed is not None else secrets.randbits(31)
    command = [
        options.executable, "serve", str(weights_dir or model_dir),
        "--host", engine.host,
        "--port", str(port),
        "--served-model-name", options.served_model_name or str(model_dir),
        "--tokenizer", str(model_dir),
        "--max-model-len", str(engine.max_context),
        "--max-num-seqs", str(engine.max_batch),
        "--seed", str(seed),
        "--logprobs-mode", "processed_logprobs",
        "--return-tokens-as-token-ids",
        "--generation-config", "vllm",
    ]  # fmt: skip
    options_flags = engine_flags(engine)
    for flag in (f for f in options_flags if f.startswith("--")):
        base = flag.removeprefix("--").removeprefix("no-")
        twice = [a for a in engine.extra_args if a.split("=")[0] in (f"--{base}", f"--no-{base}")]
        if twice:
            raise ValueError(f"engine.extra_args sets {twice[0]}, which the engine section already sets ({flag})")
    command += options_flags + engine.extra_args
    return LaunchPlan(command=command, env={"VLLM_SERVER_DEV_MODE": "1"}, url=f"http://{engine.host}:{port}")
