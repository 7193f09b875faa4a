"""`vllm serve` on rollout hosts: which vLLM runs, the supported range, the
command line the project needs, and a check of the installed version before launch.

Which `vllm` (`find_vllm`): `$LEGORL_VLLM`, else the one on PATH (a GPU host's
install), else set-up's CPU build, `$LEGORL_CACHE/vllm-venv/bin/vllm`
(`scripts/setup` installs it with `scripts/vllm_cli.py` as its command, since
the CPU wheel's own dies at start-up).

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
  processing (every version in the range has it), wrapped by
  `--worker-extension-cls` (`vllm_ext/legorl_vllm_ext.py`) so that a tied LM
  head follows its new embedding (vLLM's own reload leaves it on the old one).
- `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True` when `engine.extra_args` has
  `--enable-lora`: serves /v1/load_lora_adapter and /v1/unload_lora_adapter,
  through which PEFT adapters (`save_peft`) are loaded by name while it runs
  (tests/rollout/test_vllm_lora.py checks them against transformers + peft).
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import shutil
import socket
import subprocess
from pathlib import Path

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from legorl_jax.core.config import EngineConfig, cache_root
from legorl_jax.core.errors import InputError
from rollout_server.backends.adapters import installed_adapter
from rollout_server.backends.client import TokenRoute
from rollout_server.backends.supervisor import LaunchPlan

# The worker methods the launcher adds (vllm_ext/legorl_vllm_ext.py: the reload that keeps tied
# embeddings tied), importable by vLLM's workers from EXTENSION_DIR on their PYTHONPATH.
EXTENSION_DIR = Path(__file__).parent / "vllm_ext"
WORKER_EXTENSION = "legorl_vllm_ext.LegorlWorkerExtension"
RELOAD_METHOD = "legorl_reload_weights"

# Kept equal to the `vllm` extra in pyproject.toml (a test compares them).
# Below 0.17: no /pause (0.11), keep mode aborting requests (0.14-0.15), or a
# prefix-cache reset that fails silently with requests in flight (0.16).
SUPPORTED_VLLM = SpecifierSet(">=0.17,<0.34")


class VllmVersionError(RuntimeError, InputError):
    """The installed vLLM is missing or outside SUPPORTED_VLLM."""


def find_vllm() -> str:
    """The `vllm` command to launch: `$LEGORL_VLLM`, the one on PATH, or set-up's CPU build."""
    chosen = os.environ.get("LEGORL_VLLM")
    if chosen:
        return chosen
    on_path = shutil.which("vllm")
    if on_path:
        return on_path
    return str(cache_root() / "vllm-venv" / "bin" / "vllm")


def _missing(executable: str) -> str:
    return (
        f"vLLM not found: `{executable}` is not an executable; run ./scripts/setup (vLLM's CPU build), "
        f"`pip install 'vllm{SUPPORTED_VLLM}'` on a GPU host, or point LEGORL_VLLM at a `vllm` command"
    )


@dataclasses.dataclass(frozen=True)
class VllmOptions:
    executable: str = dataclasses.field(default_factory=find_vllm)
    served_model_name: str | None = None
    seed: int | None = None  # None: a random seed per launch, so no two hosts share one


def free_port(host: str) -> int:
    """A port nothing listens on right now (for subprocess servers, which
    cannot report a port-0 choice back)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def check_vllm_version(executable: str | None = None, timeout_s: float = 300.0) -> Version:
    """The version `vllm --version` reports (the CPU build's reads `0.32.0+cpu`), if
    SUPPORTED_VLLM contains it; otherwise a VllmVersionError that says what is
    installed and what to install."""
    executable = executable or find_vllm()
    path = shutil.which(executable)
    if path is None:
        raise VllmVersionError(_missing(executable))
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


# vLLM sizes its KV cache as a fraction of the device's memory (--gpu-memory-utilization,
# 0.9); on CPU that device is the host's RAM, and one engine of a tiny model took 22 GB
# of 24 here, leaving nothing for a second. The CPU build gets a fixed pool unless the
# engine section sets one: requests beyond it wait.
CPU_KV_CACHE_BYTES = 2 * 2**30


def with_cpu_defaults(engine: EngineConfig, version: Version) -> EngineConfig:
    """The engine section as launched by `version`: on the CPU build (`+cpu`), an unset
    KV pool becomes CPU_KV_CACHE_BYTES."""
    if version.local == "cpu" and engine.kv_cache_memory_bytes is None:
        return engine.model_copy(update={"kv_cache_memory_bytes": CPU_KV_CACHE_BYTES})
    return engine


def token_route(version: Version) -> TokenRoute:
    """Where token-id calls go on this vLLM: 0.32's /v1/completions returns no
    per-token weight versions even when asked, its generate route does; from 0.33
    /v1/completions does (before 0.32 neither: completions, without versions)."""
    return "generate" if Version("0.32") <= Version(version.base_version) < Version("0.33") else "completions"


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
    options: VllmOptions | None = None,
    weights_dir: str | Path | None = None,
    route: TokenRoute = "completions",
) -> LaunchPlan:
    """The command serving `weights_dir` (default: `model_dir`) under the name and
    tokenizer of `model_dir`; each call draws a new seed unless one is configured.
    An adapter version in `weights_dir` is served on `model_dir` under its adapter
    name. The generate `route` is served only with --enable-scale-out."""
    options = options or VllmOptions()
    if shutil.which(options.executable) is None:
        raise FileNotFoundError(_missing(options.executable))
    port = engine.port or free_port(engine.host)
    seed = options.seed if options.seed is not None else secrets.randbits(31)
    adapter = installed_adapter(weights_dir)
    command = [
        options.executable, "serve", str(model_dir if adapter else weights_dir or model_dir),
        "--host", engine.host,
        "--port", str(port),
        "--served-model-name", options.served_model_name or str(model_dir),
        "--tokenizer", str(model_dir),
        "--max-num-seqs", str(engine.max_batch),
        "--seed", str(seed),
        "--logprobs-mode", "processed_logprobs",
        "--return-tokens-as-token-ids",
        "--generation-config", "vllm",
    ]  # fmt: skip
    if engine.max_context is not None:
        command += ["--max-model-len", str(engine.max_context)]
    options_flags = engine_flags(engine)
    for flag in (f for f in options_flags if f.startswith("--")):
        base = flag.removeprefix("--").removeprefix("no-")
        twice = [a for a in engine.extra_args if a.split("=")[0] in (f"--{base}", f"--no-{base}")]
        if twice:
            raise ValueError(f"engine.extra_args sets {twice[0]}, which the engine section already sets ({flag})")
    command += ["--worker-extension-cls", WORKER_EXTENSION] + options_flags + engine.extra_args
    if route == "generate":
        command.append("--enable-scale-out")
    if adapter is not None:
        command += ["--lora-modules", f"{adapter.name}={weights_dir}"]
    pythonpath = os.pathsep.join(p for p in (str(EXTENSION_DIR), os.environ.get("PYTHONPATH", "")) if p)
    env = {"VLLM_SERVER_DEV_MODE": "1", "PYTHONPATH": pythonpath}
    if "--enable-lora" in engine.extra_args:
        # Adapter versions arrive while it runs (/v1/load_lora_adapter), which vLLM serves only with this set.
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    return LaunchPlan(command=command, env=env, url=f"http://{engine.host}:{port}")
