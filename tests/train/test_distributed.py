"""Two CPU processes joined by jax.distributed run one step over a mesh that spans
both, and agree with each other and with a single-process run of the same step."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from workers import distributed_step

from legorl_jax.train.distributed import DistributedSpec, distributed_spec, initialize_distributed

WORKER = Path(__file__).with_name("workers.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow  # two jax.distributed processes, each compiling the step
def test_two_processes_run_one_step(worker_env: dict[str, str]) -> None:
    port = _free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), "distributed"],
            env={
                **worker_env,
                "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
                "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
                "JAX_NUM_PROCESSES": "2",
                "JAX_PROCESS_ID": str(i),
            },
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    outputs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=600)
            assert p.returncode == 0, err[-3000:]
            outputs.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [o["process_index"] for o in outputs] == [0, 1]
    assert all(o["joined"] and o["process_count"] == 2 and o["devices"] == 4 for o in outputs)
    assert outputs[0]["loss"] == outputs[1]["loss"]
    assert outputs[0]["param_sum"] == outputs[1]["param_sum"]
    # The same step in this (single-device) process.
    local = distributed_step(tensor=1)
    assert not local["joined"]
    assert outputs[0]["loss"] == pytest.approx(local["loss"], rel=1e-5)
    assert outputs[0]["grad_norm"] == pytest.approx(local["grad_norm"], rel=1e-4)
    assert outputs[0]["param_sum"] == pytest.approx(local["param_sum"], rel=1e-5)


def test_environment_selects_the_mode() -> None:
    assert distributed_spec({}) is None
    assert distributed_spec({"LEGORL_DISTRIBUTED": "auto"}) == DistributedSpec(None, None, None)
    explicit = {"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234", "JAX_NUM_PROCESSES": "4", "JAX_PROCESS_ID": "3"}
    assert distributed_spec(explicit) == DistributedSpec("10.0.0.1:1234", 4, 3)
    assert initialize_distributed({}) is False


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"JAX_COORDINATOR_ADDRESS": "h:1"}, "JAX_NUM_PROCESSES, JAX_PROCESS_ID missing"),
        ({"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "two", "JAX_PROCESS_ID": "0"}, "not an integer"),
        ({"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "2"}, "0 <= JAX_PROCESS_ID"),
        ({"LEGORL_DISTRIBUTED": "yes"}, "only value is 'auto'"),
    ],
)
def test_bad_environment_is_a_clear_error(env: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        distributed_spec(env)


def test_auto_without_a_cluster_is_a_clear_error(worker_env: dict[str, str], tmp_path: Path) -> None:
    """LEGORL_DISTRIBUTED=auto where JAX detects no cluster (this machine): a config error, no traceback.
    In a fresh process: JAX joins a group only before its first computation."""
    done = subprocess.run(
        [sys.executable, "-m", "legorl_jax.cli", "train", "--set", f"logging.run_dir={tmp_path}"],
        env={**worker_env, "LEGORL_DISTRIBUTED": "auto"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert "LEGORL_DISTRIBUTED=auto: JAX could not join a process group" in done.stderr
    assert "Traceback" not in done.stderr
