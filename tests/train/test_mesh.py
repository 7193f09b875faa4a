"""An 8-fake-device mesh (fsdp=4 × tensor=2) computes the same step as one device.

XLA_FLAGS must be set before JAX starts, so the comparison runs in a subprocess.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("workers.py")


@pytest.mark.slow  # a subprocess compiling the step on eight virtual devices
@pytest.mark.parametrize("mode", ["mesh", "scored_mesh"])  # scored_mesh: LM head at loss targets only on 8
def test_sharded_step_matches_one_device(worker_env: dict[str, str], mode: str) -> None:
    env = {**worker_env, "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    proc = subprocess.run([sys.executable, str(WORKER), mode], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["devices"] == 8
    one, eight = result["loss"]
    assert eight == pytest.approx(one, rel=1e-5)
    assert result["grad_diff"] <= 1e-5 * result["grad_scale"]
    assert result["param_diff"] < 1e-5
