"""`legorl train` end to end, as a user runs it, killed with SIGKILL mid-run
(or stopped by a full disk) and started again: the run continues from its last
checkpoint with no step lost or repeated and one continuous metrics file.

The model is a tiny random Qwen3; the task is `coinflip` (a test instrument
whose verifier grades at random) so every step has reward contrast to train
on; trials run in the local sandbox to keep the test short.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from process_report import failure_report

# Whole `legorl train` runs in subprocesses: minutes each.
pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent


def train_command(model_dir: Path, run_dir: Path, steps: int) -> list[str]:
    overrides = {
        "model.path": str(model_dir),
        "tasks.demo": "false",
        "tasks.train": f"[{HERE / 'coinflip'}]",
        "tasks.eval_every": "2",
        "total_steps": str(steps),
        "rl.group_size": "2",
        "rl.groups_per_step": "1",
        "rl.sampling.max_tokens": "16",
        "sandbox.kind": "local",
        "logging.run_dir": str(run_dir),
        "logging.run_name": "e2e",
        "learner.checkpoint.every_steps": "1",
        "learner.checkpoint.async_save": "false",
        "learner.length_buckets": "[1024, 2048]",
        "harness_mix.harnesses": "[{name: lego, options: {tools: bash_only, turn_budget: short}}]",
    }
    args = [sys.executable, "-m", "legorl_jax.cli", "train", "--no-progress"]
    for key, value in overrides.items():
        args += ["--set", f"{key}={value}"]
    return args


def train_steps(metrics: Path) -> list[int]:
    if not metrics.is_file():
        return []
    steps = []
    for line in metrics.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if record.get("kind") == "train":
            steps.append(record["step"])
    return steps


def test_sigkill_then_rerun_continues_without_losing_or_repeating_steps(model_dir: Path, tmp_path: Path) -> None:
    run = tmp_path / "e2e"
    metrics = run / "metrics.jsonl"
    command = train_command(model_dir, tmp_path, steps=4)
    first = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 600
    while len(train_steps(metrics)) < 2:
        assert first.poll() is None, first.stdout.read().decode()[-3000:]
        assert time.monotonic() < deadline, "no second step within 10 minutes"
        time.sleep(0.5)
    first.send_signal(signal.SIGKILL)
    first.wait()
    killed_at = max(train_steps(metrics))

    second = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert second.returncode == 0, failure_report(second)
    assert "resumed from checkpoint" in second.stderr
    steps = train_steps(metrics)
    assert steps == [1, 2, 3, 4], f"killed after step {killed_at}; steps recorded {steps}"
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    evals = [r["step"] for r in records if r.get("kind") == "eval"]
    assert evals == [0, 2, 4], f"killed after step {killed_at}"
    for r in records:
        if r.get("kind") == "train":
            assert r["policy_version"] == r["step"]
            if "logprob_diff_mean" in r:  # absent on a step no group had contrast for
                # learner and engine score the same tokens with the same weights
                assert r["logprob_diff_mean"] < 1e-3
    rollouts = [json.loads(line) for line in (run / "rollouts.jsonl").read_text().splitlines()]
    assert sorted({r["step"] for r in rollouts if r["kind"] == "train"}) == [1, 2, 3, 4]
    assert {r["step"] for r in rollouts if r["kind"] == "eval"} == set(evals)
    assert (run / "reward.png").is_file()
    assert (run / "weights" / "LATEST").read_text().strip() == "v00000004"
    assert any((run / "tensorboard").iterdir())
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.isdigit())[-1] == "4"


@pytest.mark.skipif(os.geteuid() != 0, reason="a small disk is a tmpfs mount, which needs root")
def test_a_full_disk_stops_the_run_with_a_message_and_the_rerun_continues(model_dir: Path, tmp_path: Path) -> None:
    """The run directory on a disk four times the model's size: a step's checkpoint (weights and
    Adam's two moments) and published version fill it within the first steps."""
    disk = tmp_path / "disk"
    disk.mkdir()
    size_kib = 4 * sum(f.stat().st_size for f in model_dir.iterdir()) // 1024
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kib}k", "tmpfs", str(disk)], check=True)
    try:
        command = train_command(model_dir, disk, steps=3)
        full = subprocess.run(command, capture_output=True, text=True, timeout=900)
        assert full.returncode == 1, failure_report(full)
        # One line says it (a checkpoint writer's threads may still print at interpreter exit, after it).
        said = [line for line in full.stderr.splitlines() if line.startswith("legorl train: the disk is full (")]
        assert said and "No space left on device" in said[0], failure_report(full)
        stopped_at = train_steps(disk / "e2e" / "metrics.jsonl")
        subprocess.run(["mount", "-o", "remount,size=256m", str(disk)], check=True)
        again = subprocess.run(command, capture_output=True, text=True, timeout=900)
        assert again.returncode == 0, failure_report(again)
        steps = train_steps(disk / "e2e" / "metrics.jsonl")
        assert steps == [1, 2, 3], f"stopped after steps {stopped_at}; steps recorded {steps}"
        assert (disk / "e2e" / "weights" / "LATEST").read_text().strip() == "v00000003"
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def du(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.iterdir())


@pytest.mark.parametrize("deltas", [False, True], ids=["full", "deltas-relayed"])
def test_streamed_weights_to_a_chosen_directory(model_dir: Path, tmp_path: Path, deltas: bool) -> None:
    """weights_transport=stream: the fleet loads every version over StreamWeights, not from the path;
    with deltas, versions between full checkpoints carry only what changed, relayed down the servers."""
    weights = tmp_path / "published"
    command = train_command(model_dir, tmp_path, steps=2) + [
        "--set",
        "fleet.weights_transport=stream",
        "--set",
        f"fleet.weights_dir={weights}",
        "--verbose",
    ]
    if deltas:
        command += ["--set", "fleet.weights_full_every=2", "--set", "fleet.weights_relay=true"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, failure_report(done)
    assert "policy version 2 loaded (streamed)" in done.stderr
    assert "(from its location)" not in done.stderr
    assert (weights / "LATEST").read_text().strip() == "v00000002"
    assert not (tmp_path / "e2e" / "weights").exists()
    records = [json.loads(line) for line in (tmp_path / "e2e" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r.get("kind") == "train"]
    assert [r["step"] for r in train] == [1, 2]
    assert all(r["time/publish_s"] > 0 and r["time/reload_s"] > 0 for r in train)
    # What each step published: a server serving the version before fetches the delta, else the whole directory.
    changed = [r["weights/changed_frac"] for r in train]
    fetched = (weights / "v00000002" / "delta.bin").stat().st_size if deltas else du(weights / "v00000002")
    assert train[-1]["weights/bytes"] == fetched
    assert all(0.0 <= c <= 1.0 for c in changed) if deltas else changed == [1.0, 1.0], changed
