"""`legorl train` as one job on several JAX processes (docs/multihost.md), as a
user starts it on one machine: two CPU processes × 2 devices, a 4-device mesh
with `fsdp` across them, the coinflip task in the local sandbox.

One set of run records, both processes exit 0, a resume continues where the
job stopped; a killed process stops the other within the heartbeat bound;
and with seeded rollouts the job trains exactly as one process with 4 devices.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from tests.loop.test_train_e2e import train_command, train_steps

pytestmark = pytest.mark.slow  # whole multi-process `legorl train` runs: about a minute each

HERE = Path(__file__).resolve().parent
HEARTBEAT_S = 10
FATAL = "JAX distributed service detected fatal errors"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Job:
    procs: list[subprocess.Popen[str]]
    logs: list[Path]

    def wait(self, timeout: float) -> list[int]:
        deadline = time.monotonic() + timeout
        try:
            return [p.wait(timeout=max(deadline - time.monotonic(), 1)) for p in self.procs]
        finally:
            self.kill()

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()

    def report(self) -> str:
        return "\n".join(f"--- process {i} (exit {p.returncode}) ---\n{log.read_text()[-3000:]}"
                         for i, (p, log) in enumerate(zip(self.procs, self.logs, strict=True)))  # fmt: skip


def start(command: list[str], tmp_path: Path, *, processes: int, devices: int, name: str) -> Job:
    """`command` on `processes` processes joined by jax.distributed, `devices` CPU devices each."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    port = _free_port()
    procs, logs = [], []
    for i in range(processes):
        group = {}
        if processes > 1:
            group = {"JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}", "JAX_NUM_PROCESSES": str(processes),
                     "JAX_PROCESS_ID": str(i)}  # fmt: skip
        log = tmp_path / f"{name}.{i}.log"
        with log.open("w") as out:
            procs.append(
                subprocess.Popen(command, env={**env, **group}, stdout=out, stderr=subprocess.STDOUT, text=True)
            )
        logs.append(log)
    return Job(procs, logs)


def command(model_dir: Path, run_dir: Path, steps: int, *extra: str, task: str = "coinflip") -> list[str]:
    args = train_command(model_dir, run_dir, steps) + [
        "--set", "learner.mesh.fsdp=-1",
        "--set", f"learner.heartbeat_timeout_s={HEARTBEAT_S}",
        "--set", f"tasks.train=[{HERE / task}]",
    ]  # fmt: skip
    for item in extra:
        args += ["--set", item]
    return args


def records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_two_processes_are_one_job_and_resume_as_one(model_dir: Path, tmp_path: Path) -> None:
    run = tmp_path / "e2e"
    job = start(command(model_dir, tmp_path, 3), tmp_path, processes=2, devices=2, name="first")
    assert job.wait(600) == [0, 0], job.report()
    logs = [log.read_text() for log in job.logs]
    assert "joined the process group: process 0 of 2: 2 local cpu devices, 4 in all" in logs[0]
    assert "joined the process group: process 1 of 2: 2 local cpu devices, 4 in all" in logs[1]
    assert "legorl train: done; metrics in" in logs[0]
    assert "process 0 wrote the run's records" in logs[1]
    # One set of records: every step once, evaluations once, every version published once.
    assert train_steps(run / "metrics.jsonl") == [1, 2, 3]
    assert [r["step"] for r in records(run) if r["kind"] == "eval"] == [0, 2, 3]
    assert sorted(p.name for p in (run / "weights").iterdir()) == ["LATEST", "v00000001", "v00000002", "v00000003"]
    for r in records(run):
        if r["kind"] == "train" and "logprob_diff_mean" in r:
            assert r["logprob_diff_mean"] < 1e-3  # the fleet served what the 2-process learner trained

    # Resumed with rollouts one step ahead of the learner: process 0 collects ahead, the others still only
    # train on what it sends.
    resumed = start(command(model_dir, tmp_path, 5, "rl.max_policy_lag=1"), tmp_path, processes=2, devices=2,
                    name="second")  # fmt: skip
    assert resumed.wait(600) == [0, 0], resumed.report()
    for log in resumed.logs:
        assert "resumed from checkpoint at step 3 (policy version 3)" in log.read_text()
    assert train_steps(run / "metrics.jsonl") == [1, 2, 3, 4, 5]
    assert (run / "weights" / "LATEST").read_text().strip() == "v00000005"


@pytest.mark.parametrize(
    ("victim", "sig", "said"),
    [
        (1, signal.SIGKILL, (FATAL,)),
        (0, signal.SIGKILL, (FATAL,)),
        # Told at once; but process 0 held in a collective (or a checkpoint's barrier) that the stopped
        # process never joins hears it from the heartbeat.
        (1, signal.SIGTERM, ("process 1 stopped the run: CancelledError", FATAL)),
    ],
    ids=["follower-killed", "leader-killed", "follower-terminated"],
)
def test_a_stopped_process_stops_the_other(
    model_dir: Path, tmp_path: Path, victim: int, sig: signal.Signals, said: tuple[str, ...]
) -> None:
    run = tmp_path / "e2e"
    job = start(command(model_dir, tmp_path, 50), tmp_path, processes=2, devices=2, name="killed")
    try:
        deadline = time.monotonic() + 600
        while len(train_steps(run / "metrics.jsonl")) < 2:
            assert all(p.poll() is None for p in job.procs), job.report()
            assert time.monotonic() < deadline, "no second step within 10 minutes"
            time.sleep(0.5)
        job.procs[victim].send_signal(sig)
        killed = time.monotonic()
        survivor = job.procs[1 - victim]
        survivor.wait(timeout=HEARTBEAT_S + 50)
        stopped_after = time.monotonic() - killed
    finally:
        job.kill()
    assert survivor.returncode != 0, job.report()
    assert stopped_after < HEARTBEAT_S + 50
    assert any(words in job.logs[1 - victim].read_text() for words in said), job.report()
    # Nothing half-published is a version: LATEST names a complete one.
    latest = (run / "weights" / "LATEST").read_text().strip()
    assert (run / "weights" / latest / "weights.json").is_file()


def test_two_processes_train_as_one_with_four_devices(model_dir: Path, tmp_path: Path) -> None:
    """Seeded rollouts of a verifier that grades by a hash of the agent's words: the same batches reach
    both jobs, so the 2 × 2-device job must train as 1 × 4 devices does."""
    seeded = ("seed=7", "tasks.eval_every=100")
    one = start(command(model_dir, tmp_path / "one", 3, *seeded, task="hashflip"), tmp_path,
                processes=1, devices=4, name="one")  # fmt: skip
    assert one.wait(600) == [0], one.report()
    two = start(command(model_dir, tmp_path / "two", 3, *seeded, task="hashflip"), tmp_path,
                processes=2, devices=2, name="two")  # fmt: skip
    assert two.wait(600) == [0, 0], two.report()
    runs = [tmp_path / name / "e2e" for name in ("one", "two")]
    steps = [[r for r in records(run) if r["kind"] == "train"] for run in runs]
    assert [r["step"] for r in steps[0]] == [r["step"] for r in steps[1]] == [1, 2, 3]
    assert any("loss" in r for r in steps[0]), "no step had reward contrast: nothing was compared"
    episodes = [[json.loads(line)["sampled"] for line in (run / "rollouts.jsonl").open()] for run in runs]
    assert episodes[0] == episodes[1]  # the same seeds sampled the same episodes
    for a, b in zip(*steps, strict=True):
        assert a.get("reward/mean") == b.get("reward/mean")
        if "loss" in a:
            assert b["loss"] == pytest.approx(a["loss"], abs=1e-5)
    # Not bit for bit: Gloo sums the shards' gradients across processes in another order than one process
    # does, and Adam turns float noise in near-zero gradients into updates of up to the learning rate.
    # So the two jobs' updates must agree closely, where a process training alone on its own batch
    # would be off by the whole update.
    first, ends = read_weights(model_dir), [read_weights(run / "weights" / "v00000003") for run in runs]
    apart = sum(float(np.sum((ends[0][k] - ends[1][k]) ** 2)) for k in first) ** 0.5
    update = sum(float(np.sum((ends[0][k] - first[k]) ** 2)) for k in first) ** 0.5
    assert update > 0 and apart / update < 1e-3, (apart, update)


def read_weights(directory: Path) -> dict[str, np.ndarray]:
    return {k: v.astype(np.float64) for k, v in load_file(directory / "model.safetensors").items()}
