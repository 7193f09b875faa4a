"""A signal to `legorl train` while an update or a publish runs: the command ends
within a bound, however long that work would take (it is stalled here for an
hour by `stalling_train.py`), with no traceback; what was cut short left nothing
a resumed run reads (a publish's staging directory, never `LATEST` on an
unfinished version), and the same command then resumes from the last finished
checkpoint and finishes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from process_report import failure_report

from .test_train_e2e import train_command, train_steps

# Two `legorl train` runs in subprocesses.
pytestmark = pytest.mark.slow

STALLING_TRAIN = Path(__file__).with_name("stalling_train.py")
# The in-process rollout server's drain and the logs' closing, on two shared cores.
EXIT_BOUND_S = 30


@pytest.mark.parametrize(
    ("phase", "sig"),
    [("publish", signal.SIGTERM), ("update", signal.SIGINT)],
    ids=["publish-sigterm", "update-ctrl-c"],
)
def test_a_stop_mid_update_or_publish_is_bounded_quiet_and_resumable(
    model_dir: Path, tmp_path: Path, phase: str, sig: signal.Signals
) -> None:
    run = tmp_path / "e2e"
    # Enough rounds that step 2 has a group with reward contrast to update on (coinflip grades at random).
    command = train_command(model_dir, tmp_path, steps=3) + ["--set", "rl.max_sampling_rounds=12"]
    stalled = [sys.executable, str(STALLING_TRAIN), phase, "2", *command[3:]]
    assert command[1:3] == ["-m", "legorl_jax.cli"]
    log = tmp_path / "train.log"
    with log.open("wb") as sink:
        # Its own process group: SIGINT goes to the whole group, as Ctrl-C in a terminal sends it.
        proc = subprocess.Popen(stalled, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while f"stalled: {phase} 2" not in log.read_text():
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, f"step 2's {phase} not reached within 10 minutes"
            time.sleep(0.2)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    took = stop(proc, sig, log)
    output = log.read_text()
    assert proc.returncode == 128 + sig, output[-3000:]
    assert took < EXIT_BOUND_S
    assert "Traceback" not in output, output
    # Step 2 did not finish: the line names step 1, the last one whose weights are out.
    assert f"stopped by {sig.name} after step 1;" in output, output[-3000:]
    assert train_steps(run / "metrics.jsonl") == [1]
    weights = run / "weights"
    assert (weights / "LATEST").read_text().strip() == "v00000001"
    assert not (weights / "v00000002").exists()
    staging = [p.name for p in weights.iterdir() if p.name.startswith(".publishing-")]
    assert len(staging) == (phase == "publish"), staging

    again = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert again.returncode == 0, failure_report(again)
    assert "resumed from checkpoint at step 1 " in again.stderr
    assert "Traceback" not in again.stdout + again.stderr, failure_report(again)
    assert train_steps(run / "metrics.jsonl") == [1, 2, 3]
    assert (weights / "LATEST").read_text().strip() == "v00000003"
    assert not [p.name for p in weights.iterdir() if p.name.startswith(".publishing-")]


def stop(proc: subprocess.Popen[bytes], sig: signal.Signals, log: Path) -> float:
    """Sends `sig` (SIGINT to the whole group, as Ctrl-C does) and waits for the exit: the
    seconds it took. Still running after `EXIT_BOUND_S`: killed, and the test fails."""
    signalled = time.monotonic()
    if sig == signal.SIGINT:
        os.killpg(proc.pid, sig)
    else:
        proc.send_signal(sig)
    try:
        proc.wait(timeout=EXIT_BOUND_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise AssertionError(f"still running {EXIT_BOUND_S} s after {sig.name}:\n{log.read_text()[-3000:]}") from None
    return time.monotonic() - signalled
