"""Orbax checkpoints: a run killed after step n and restored continues exactly
like a run that was never interrupted; retention and save cadence follow config."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from tiny import learner_config, random_sequences, rl_config, tiny_model

from legorl_jax.core.config import CheckpointConfig, MeshConfig
from legorl_jax.train.checkpoint import Checkpointer
from legorl_jax.train.sharding import learner_mesh
from legorl_jax.train.step import Learner

WORKER = Path(__file__).with_name("workers.py")
N, M = 2, 2


def _learner() -> Learner:
    # Must match workers.train_then_die: same model seed, configs and batch.
    return Learner(tiny_model(), rl_config(), learner_config(), learner_mesh(MeshConfig()))


@pytest.mark.slow  # training runs in subprocesses, one killed and restored
def test_kill_restore_continue_equals_uninterrupted(tmp_path: Path, worker_env: dict[str, str]) -> None:
    proc = subprocess.run(
        [sys.executable, str(WORKER), "die", "--dir", str(tmp_path / "ckpt"), "--steps", str(N)],
        env=worker_env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"saved": N}

    packed = _learner().pack(random_sequences(5, 16))
    resumed = _learner()
    ckpt = Checkpointer(tmp_path / "ckpt", CheckpointConfig(every_steps=1, keep=2))
    state = ckpt.restore_latest(resumed)
    ckpt.close()
    assert state is not None
    assert (state.step, state.policy_version, state.cursor, resumed.step) == (N, N, {"seen": N}, N)
    np.testing.assert_array_equal(jax.random.key_data(state.rng), jax.random.key_data(jax.random.key(N)))
    for _ in range(M):
        resumed.train_step(packed)

    straight = _learner()
    for _ in range(N + M):
        straight.train_step(packed)
    assert resumed.step == straight.step == N + M
    for a, b in zip(jax.tree.leaves(resumed.params), jax.tree.leaves(straight.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for a, b in zip(jax.tree.leaves(resumed.opt_state), jax.tree.leaves(straight.opt_state), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_cadence_retention_and_empty_directory(tmp_path: Path) -> None:
    learner = _learner()
    ckpt = Checkpointer(tmp_path, CheckpointConfig(every_steps=3, keep=2, async_save=False))
    assert ckpt.restore_latest(learner) is None
    saved = []
    for step in range(1, 10):
        learner.step = step  # the cadence depends on the step number only
        saved.append(ckpt.save(learner, policy_version=step, rng=jax.random.key(0)))
    assert ckpt.save(learner, policy_version=9, rng=jax.random.key(0), force=False) is False
    learner.step = 10
    assert ckpt.save(learner, policy_version=10, rng=jax.random.key(0), force=True) is True
    ckpt.wait()
    assert [s for s, ok in zip(range(1, 10), saved, strict=True) if ok] == [1, 3, 6, 9]
    assert ckpt.manager.all_steps() == [9, 10]
    ckpt.close()


def test_a_save_cut_short_is_never_restored_and_is_cleaned_up(tmp_path: Path) -> None:
    """A process stopped mid-save leaves Orbax's staging directory for that step: a resumed
    run restores the last finished step and removes the leftover before it saves."""
    learner = _learner()
    ckpt = Checkpointer(tmp_path, CheckpointConfig(every_steps=1, keep=3, async_save=False))
    for step in (1, 2):
        learner.step = step
        ckpt.save(learner, policy_version=step, rng=jax.random.key(step))
    ckpt.close()
    # Step 3's save, cut short: its files written, the directory never renamed into place.
    torn = tmp_path / "3.orbax-checkpoint-tmp-1700000000000000"
    shutil.copytree(tmp_path / "2", torn)

    resumed = _learner()
    ckpt = Checkpointer(tmp_path, CheckpointConfig(every_steps=1, keep=3, async_save=False))
    state = ckpt.restore_latest(resumed)
    assert state is not None and (state.step, state.policy_version, resumed.step) == (2, 2, 2)
    resumed.step = 3
    assert ckpt.save(resumed, policy_version=3, rng=state.rng)
    ckpt.wait()
    ckpt.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["1", "2", "3"]
