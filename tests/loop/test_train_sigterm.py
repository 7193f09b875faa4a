"""SIGTERM to `legorl train` (in-process rollout server, embedded engine, Docker
sandboxes) while trials run: it exits promptly with 143 and a line saying how
to resume, leaving no trial container, no proxy network of its own and no
engine process; the same command then resumes from the last checkpoint."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import time
from pathlib import Path

import docker
import pytest
from process_report import failure_report

from rollout_server.sandbox.reaper import OWNER_LABEL, TRIAL_LABEL

from .test_train_e2e import train_command, train_steps

pytestmark = [pytest.mark.slow, pytest.mark.docker]

# The engine's own drain and the trials' teardown, on two shared cores.
EXIT_BOUND_S = 60


def own_trials(client: docker.DockerClient, pid: int) -> list[dict]:
    """Trial containers, running or not, that process `pid` created (others' share the daemon)."""
    return [
        c
        for c in client.api.containers(all=True, filters={"label": TRIAL_LABEL})
        if f"/{pid}/" in (c.get("Labels") or {}).get(OWNER_LABEL, "")
    ]


def descendants(pid: int) -> set[int]:
    """Every process below `pid`, read from /proc."""
    found: set[int] = set()
    todo = [pid]
    while todo:
        for children in Path(f"/proc/{todo.pop()}/task").glob("*/children"):
            with contextlib.suppress(OSError):  # the thread ended meanwhile
                for child in map(int, children.read_text().split()):
                    found.add(child)
                    todo.append(child)
    return found


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie awaiting its parent's wait does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_sigterm_stops_everything_it_started_and_the_run_resumes(model_dir: Path, tmp_path: Path) -> None:
    client = docker.from_env()
    command = train_command(model_dir, tmp_path, steps=3) + ["--set", "sandbox.kind=docker"]
    metrics = tmp_path / "e2e" / "metrics.jsonl"
    log = tmp_path / "train.log"
    with log.open("wb") as sink:
        proc = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT)
    try:
        # After the first checkpointed step, catch a trial of the next one in its container.
        deadline = time.monotonic() + 600
        trials: list[dict] = []
        while not (train_steps(metrics) and trials):
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "no trial container after the first step within 10 minutes"
            time.sleep(0.2)
            trials = [c for c in own_trials(client, proc.pid) if c["State"] == "running"]
        networks = {name for c in trials for name in c["NetworkSettings"]["Networks"] if name.startswith("legorl-")}
        assert networks, trials
        started = descendants(proc.pid)
        assert started, "no engine subprocess"

        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=EXIT_BOUND_S)
        took = time.monotonic() - signalled
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    output = log.read_text()
    assert code == 128 + signal.SIGTERM, output[-3000:]
    assert "stopped by SIGTERM" in output and "run the same command again" in output, output[-3000:]
    assert took < EXIT_BOUND_S
    assert own_trials(client, proc.pid) == []
    assert networks.isdisjoint(n.name for n in client.networks.list())
    left = [pid for pid in started if alive(pid)]
    assert left == [], f"processes of the run still alive: {left}"
    lines = metrics.read_text().splitlines(keepends=True)
    assert all(line.endswith("\n") for line in lines), "metrics.jsonl has a torn line"

    done_before = max(train_steps(metrics))
    again = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert again.returncode == 0, failure_report(again)
    assert f"resumed from checkpoint at step {done_before}" in again.stderr
    assert train_steps(metrics) == [1, 2, 3]
    client.close()
