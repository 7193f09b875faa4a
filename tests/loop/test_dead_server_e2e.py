"""`legorl train` against a fleet of two real `legorl rollout-server` processes,
one of which is SIGKILLed mid-run: its trials are re-issued on the other, the
weights keep reaching the survivor, and the run finishes every step.

Shortened embedded config: tiny random Qwen3, the `coinflip` task (a test
instrument whose verifier grades at random, so every step has contrast), local
sandboxes.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .test_train_e2e import HERE, train_command, train_steps

LEGORL = str(Path(sys.executable).with_name("legorl"))
_LISTENING = re.compile(r"rollout server on (\S+)")
# Two rollout servers and a trainer in subprocesses: minutes.
pytestmark = pytest.mark.slow


def start_server(model: Path, log_path: Path) -> tuple[subprocess.Popen, str]:
    settings = {
        "tasks.demo": "false",
        "tasks.train": f"[{HERE / 'coinflip'}]",
        "sandbox.kind": "local",
        "fleet.capacity_per_server": "2",
        # The trainer publishes under the test's directory: shared storage, as a real fleet's.
        "fleet.weights_location_roots": f"[{log_path.parent}]",
    }
    argv = [LEGORL, "rollout-server", "--model", str(model), "--address", "127.0.0.1:0"]
    for key, value in settings.items():
        argv += ["--set", f"{key}={value}"]
    log = log_path.open("w")
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if match := _LISTENING.search(log_path.read_text()):
            return proc, match.group(1)
        assert proc.poll() is None, log_path.read_text()[-3000:]
        time.sleep(0.5)
    proc.kill()
    raise AssertionError("rollout server did not start within 5 minutes:\n" + log_path.read_text()[-3000:])


def test_a_rollout_server_killed_mid_run_does_not_stop_training(model_dir: Path, tmp_path: Path) -> None:  # noqa: F811
    servers = [start_server(model_dir, tmp_path / f"server{i}.log") for i in range(2)]
    try:
        addresses = ",".join(address for _, address in servers)
        command = train_command(model_dir, tmp_path, steps=4) + [
            "--set",
            f"fleet.servers=[{addresses}]",
            "--set",
            "rl.groups_per_step=2",
        ]
        trainer = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        metrics = tmp_path / "e2e" / "metrics.jsonl"
        deadline = time.monotonic() + 600
        while not train_steps(metrics):
            assert trainer.poll() is None, trainer.stdout.read()[-3000:]
            assert time.monotonic() < deadline, "no first step within 10 minutes"
            time.sleep(0.5)
        victim, _ = servers[0]
        victim.send_signal(signal.SIGKILL)
        victim.wait()
        out, _ = trainer.communicate(timeout=900)
        assert trainer.returncode == 0, out[-3000:]
        dead = servers[0][1]
        # The fleet noticed: a failed probe, reload or group (each logs the address and "lost" or "dead").
        assert any(dead in line and ("lost" in line or "dead" in line) for line in out.splitlines()), out[-3000:]
    finally:
        for proc, _ in servers:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    proc.kill()
    assert train_steps(metrics) == [1, 2, 3, 4]
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert all(r["policy_version"] == r["step"] for r in records if r.get("kind") == "train")
    # The survivor loaded the last policy the trainer published.
    assert (tmp_path / "e2e" / "weights" / "LATEST").read_text().strip() == "v00000004"
