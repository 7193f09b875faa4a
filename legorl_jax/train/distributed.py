"""Multi-process start-up: one learner program per host, joined by
`jax.distributed.initialize()`. See docs/multihost.md for pod-slice launches.

The environment chooses the mode:
- JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID (all three):
  explicit cluster (bare hosts, CPU processes on one machine, tests);
- LEGORL_DISTRIBUTED=auto: JAX's own cluster detection (Cloud TPU pod slices,
  SLURM, Kubernetes JobSets) fills in everything;
- neither: a single process, nothing to initialise.
Must run before anything touches a JAX device.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

import jax

from legorl_jax.core.config import ConfigError

EXPLICIT_VARS = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")


@dataclass(frozen=True)
class DistributedSpec:
    coordinator_address: str | None  # None: let JAX detect the cluster
    num_processes: int | None
    process_id: int | None


def _int(environ: Mapping[str, str], name: str) -> int:
    try:
        return int(environ[name])
    except ValueError:
        raise ConfigError(f"{name}={environ[name]!r} is not an integer") from None


def distributed_spec(environ: Mapping[str, str]) -> DistributedSpec | None:
    """The multi-process setup the environment asks for; None for a single process."""
    present = [v for v in EXPLICIT_VARS if environ.get(v)]
    if present:
        missing = [v for v in EXPLICIT_VARS if v not in present]
        if missing:
            raise ConfigError(f"{', '.join(present)} set but {', '.join(missing)} missing: set all three or none")
        n, pid = _int(environ, "JAX_NUM_PROCESSES"), _int(environ, "JAX_PROCESS_ID")
        if n < 1 or not 0 <= pid < n:
            raise ConfigError(f"need JAX_NUM_PROCESSES >= 1 and 0 <= JAX_PROCESS_ID < it, got {n} and {pid}")
        return DistributedSpec(environ["JAX_COORDINATOR_ADDRESS"], n, pid)
    mode = environ.get("LEGORL_DISTRIBUTED", "")
    if mode == "auto":
        return DistributedSpec(None, None, None)
    if mode:
        raise ConfigError(f"LEGORL_DISTRIBUTED={mode!r}: the only value is 'auto'")
    return None


def initialize_distributed(environ: Mapping[str, str] | None = None, *, heartbeat_timeout_s: int = 60) -> bool:
    """Joins the process group the environment describes; False when single-process.

    A process silent for `heartbeat_timeout_s` (dead, hung, cut off) makes the
    coordination service end every other process with an error naming it."""
    spec = distributed_spec(os.environ if environ is None else environ)
    if spec is None:
        return False
    try:
        jax.distributed.initialize(
            coordinator_address=spec.coordinator_address,
            num_processes=spec.num_processes,
            process_id=spec.process_id,
            heartbeat_timeout_seconds=heartbeat_timeout_s,
        )
    except ValueError as exc:  # JAX's word for an environment it cannot read
        mode = "LEGORL_DISTRIBUTED=auto" if spec.coordinator_address is None else ", ".join(EXPLICIT_VARS)
        raise ConfigError(f"{mode}: JAX could not join a process group: {exc}") from None
    return True


def describe_group() -> str:
    """The process group as a log line: which process this is, of how many, and their devices."""
    return (
        f"process {jax.process_index()} of {jax.process_count()}: "
        f"{jax.local_device_count()} local {jax.default_backend()} devices, {jax.device_count()} in all"
    )
