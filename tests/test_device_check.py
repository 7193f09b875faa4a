"""scripts/device_check.sh, the one check run on a lent NVIDIA machine: valid
bash, and a dry run at tiny shapes on CPU that writes a complete report."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "device_check.sh"


def test_the_script_is_valid_bash() -> None:
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    assert os.access(SCRIPT, os.X_OK)


@pytest.mark.slow
def test_dry_run_writes_one_report_with_every_step(tmp_path: Path) -> None:
    report_path = tmp_path / "out" / "device_check.json"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [str(SCRIPT), "--dry-run", str(report_path)], capture_output=True, text=True, env=env, timeout=1800
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(report_path.read_text())
    assert report["dry_run"] is True and report["ok"] is True
    assert set(report["steps"]) == {"learner", "attention", "logprobs", "engine"}
    learner = report["steps"]["learner"]["report"]
    assert learner["model"]["dtype"] == "bfloat16" and learner["matmul_peak_tflops"] > 0 and 0 < learner["mfu"]
    assert "max |out diff|" in report["steps"]["attention"]["stdout"]
    assert "chunked" in report["steps"]["logprobs"]["stdout"]
    assert "engine tok/s" in report["steps"]["engine"]["stdout"]
