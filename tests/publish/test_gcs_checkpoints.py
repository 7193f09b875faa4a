"""Orbax checkpoints on `gs://`, against the GCS emulator (`emulated_gcs.py`): the arrays go through
tensorstore's gcs driver (`TENSORSTORE_GCS_HTTP_URL`), the step directories are created, listed, committed
(`commit_success.txt`) and deleted through etils.epath's gcsfs backend (`STORAGE_EMULATOR_HOST`)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from etils import epath
from flax import nnx
from orbax.checkpoint._src.serialization import tensorstore_utils as ts_utils

from legorl_jax.core.config import CheckpointConfig, LearnerConfig, MeshConfig, OptimizerConfig, RLConfig
from legorl_jax.models import CausalLM
from legorl_jax.rl.batching import TrainSequence
from legorl_jax.train.checkpoint import Checkpointer, CheckpointSaveError
from legorl_jax.train.sharding import learner_mesh
from legorl_jax.train.step import Learner

from .emulated_gcs import BUCKET, FAST_FAILING, Emulator, point_at

pytestmark = pytest.mark.gcs


def _learner(model: CausalLM) -> Learner:
    """A fresh learner on the tiny model's architecture, the same initial weights every call."""
    config = LearnerConfig(
        micro_batch_tokens=128,
        length_buckets=[32],
        optimizer=OptimizerConfig(learning_rate=1e-2, total_steps=20),
    )
    return Learner(CausalLM(model.config, rngs=nnx.Rngs(0)), RLConfig(), config, learner_mesh(MeshConfig()))


def _batch(vocab: int) -> list[TrainSequence]:
    rng = np.random.default_rng(0)
    out = []
    for _ in range(4):
        tokens = rng.integers(0, vocab, 24).astype(np.int32)
        mask = np.arange(24) >= 8
        behav = np.where(mask, -np.log(vocab), 0.0).astype(np.float32)
        out.append(TrainSequence(tokens, mask, behav, float(rng.normal())))
    return out


def _host(tree: Any) -> list[tuple[str, bytes]]:
    """Every leaf as (dtype, raw bytes): equality is bit-identity."""
    return [(str(np.asarray(x).dtype), np.asarray(x).tobytes()) for x in jax.tree.leaves(tree)]


def _train_and_save(learner: Learner, ckpt: Checkpointer, steps: range, packed: Any) -> None:
    for step in steps:
        learner.train_step(packed)
        assert learner.step == step
        assert ckpt.save(learner, policy_version=step, rng=jax.random.key(step), cursor={"seen": step})


def _finished(url: str) -> list[str]:
    """The step directories under `url` that hold Orbax's commit marker."""
    root = epath.Path(url)
    return sorted(p.name for p in root.iterdir() if (p / "commit_success.txt").exists())


def test_save_resume_round_trip(emulator: Emulator, model: CausalLM) -> None:
    url = f"gs://{BUCKET}/runs/demo/checkpoints"
    first = _learner(model)
    packed = first.pack(_batch(model.config.vocab_size))
    ckpt = Checkpointer(url, CheckpointConfig(every_steps=1, keep=2))  # async, as a run saves
    assert str(ckpt.directory) == url and ckpt.restore_latest(first) is None
    _train_and_save(first, ckpt, range(1, 4), packed)
    ckpt.wait()
    ckpt.close()
    assert _finished(url) == ["2", "3"]  # keep=2: step 1 deleted from the bucket
    assert not Path("gs:").exists() and not Path(os.getcwd(), "gs:").exists()  # nothing went to a local gs:/

    resumed = _learner(model)
    ckpt = Checkpointer(url + "/", CheckpointConfig(every_steps=1, keep=2))
    state = ckpt.restore_latest(resumed)
    assert state is not None
    assert (state.step, state.policy_version, state.cursor, resumed.step) == (3, 3, {"seen": 3}, 3)
    np.testing.assert_array_equal(jax.random.key_data(state.rng), jax.random.key_data(jax.random.key(3)))
    assert _host(resumed.params) == _host(first.params)
    assert _host(resumed.opt_state) == _host(first.opt_state)
    # Training resumes at step 4, exactly as the run that never stopped.
    _train_and_save(resumed, ckpt, range(4, 5), packed)
    first.train_step(packed)
    assert _host(resumed.params) == _host(first.params)
    ckpt.wait()
    ckpt.close()
    assert _finished(url) == ["3", "4"]


def test_malformed_url_is_refused_not_made_local(tmp_path: Path) -> None:
    for bad, why in [("gs:/legorl-test/x", "not a gs:// URL"), ("gs://B/x", "bucket name"), ("s3://b/x", "only")]:
        with pytest.raises(ValueError, match=f"checkpoint directory: .*{why}"):
            Checkpointer(bad, CheckpointConfig())
    assert not Path("gs:").exists()


def test_storage_gone_mid_save(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, model: CausalLM) -> None:
    emu = Emulator(tmp_path / "bucket-data")  # on disk: what was written outlives the restart
    emu.start()
    point_at(emu, monkeypatch)
    url = f"gs://{BUCKET}/gone"
    try:
        learner = _learner(model)
        packed = learner.pack(_batch(model.config.vocab_size))
        ckpt = Checkpointer(url, CheckpointConfig(every_steps=1, keep=3))
        _train_and_save(learner, ckpt, range(1, 3), packed)
        ckpt.wait()
        saved = _host(learner.params)
        json_save = ocp.handlers.JsonCheckpointHandler.async_save

        async def storage_dies(self: Any, *args: Any, **kwargs: Any) -> Any:
            emu.stop()  # step 3's arrays may be written, its metadata and commit marker are not
            return await json_save(self, *args, **kwargs)

        monkeypatch.setattr(ocp.handlers.JsonCheckpointHandler, "async_save", storage_dies)
        # Step 3's array writes outlive the failed save in Orbax's threads: with tensorstore's default
        # retries (minutes) they would reach the restarted emulator after the resumed run's step 3.
        for context in (ts_utils._BASE_TS_CONTEXT, ts_utils._DEFAULT_OCDBT_TS_CONTEXT):
            monkeypatch.setitem(context, "gcs_request_retries", FAST_FAILING["gcs_request_retries"])
        started = time.monotonic()
        with pytest.raises(CheckpointSaveError, match=rf"{url}: the checkpoint of step 3 .*did not finish .*connect"):
            _train_and_save(learner, ckpt, range(3, 4), packed)
            ckpt.wait()
        print(f"the save failed after {time.monotonic() - started:.1f} s (gcsfs retries with backoff)")
        monkeypatch.setattr(ocp.handlers.JsonCheckpointHandler, "async_save", json_save)
        time.sleep(1)  # the orphaned writes give up (two retries, 50 ms apart at most)

        emu.start()
        point_at(emu, monkeypatch)
        assert _finished(url) == ["1", "2"]  # whatever of step 3 was written, not its commit marker
        resumed = _learner(model)
        ckpt = Checkpointer(url, CheckpointConfig(every_steps=1, keep=3))
        state = ckpt.restore_latest(resumed)
        assert state is not None and (state.step, resumed.step) == (2, 2)
        assert _host(resumed.params) == saved
        _train_and_save(resumed, ckpt, range(3, 4), packed)  # the half step is written over
        ckpt.wait()
        ckpt.close()
        assert _finished(url) == ["1", "2", "3"]
    finally:
        emu.stop()
