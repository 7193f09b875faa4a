"""scripts/bench_fleet.py runs end to end at a tiny size: the fleet client against two real
rollout-server processes (local sandboxes, the scripted engine), a host killed mid-step and a
slow verifier, every trial back exactly once."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # the whole benchmark script: an engine and two rollout-server processes
def test_bench_runs_and_every_trial_comes_back_once(tmp_path: Path) -> None:
    out = tmp_path / "rows.json"
    args = ["--hosts", "2", "--trials", "16", "--group-size", "4", "--capacity", "4"]
    args += ["--faults", "kill", "slow_verifier", "--slow-verifier-s", "1", "--json", str(out)]
    done = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "bench_fleet.py"), *args],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert [r["hosts"] for r in rows["sweep"]] == [2]
    assert [r["fault"] for r in rows["faults"]] == ["clean", "slow_verifier", "kill"]
    for row in rows["sweep"] + rows["faults"]:
        assert row["exactly_once"], row
        assert sum(row["statuses"].values()) == 16
        assert row["collected_per_s"] > 0 and row["cpu_ms_per_traj"] > 0 and row["MB_per_s"] > 0
    assert all(r["statuses"] == {"OK": 16} for r in rows["sweep"])
    assert "| hosts | trials |" in done.stdout  # the printed table
