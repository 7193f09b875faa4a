"""The learner's per-token logprobs, as `rollouts.jsonl` records them: taken from
the packed micro-batches back to each sequence's own token order, they equal an
independent unpacked forward's, with and without shared prefixes, over several
micro-batches, with truncated and dropped sequences."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from tiny import VOCAB, learner_config, rl_config, sequence_logprobs, tiny_model

from legorl_jax.core.config import MeshConfig, SamplingConfig
from legorl_jax.rl.batching import TrainSequence
from legorl_jax.train.sharding import learner_mesh
from legorl_jax.train.step import Learner

TEMPERATURE = 0.7


@pytest.fixture(scope="module")
def mesh() -> jax.sharding.Mesh:
    return learner_mesh(MeshConfig())


def _groups(seed: int = 3) -> list[TrainSequence]:
    """Groups sharing a prompt, some with a second turn; one sequence longer than the
    largest bucket (truncated) and one with no sampled token inside it (dropped)."""
    rng = np.random.default_rng(seed)
    seqs = []
    system = rng.integers(0, VOCAB, 12)
    for _ in range(3):
        prompt = np.concatenate([system, rng.integers(0, VOCAB, 6)])
        for m in range(3):
            turn = rng.integers(0, VOCAB, int(rng.integers(3, 9)))
            result = rng.integers(0, VOCAB, 3 * (m % 2))
            second = rng.integers(0, VOCAB, 4 * (m % 2))
            tokens = np.concatenate([prompt, turn, result, second]).astype(np.int32)
            mask = np.zeros(len(tokens), bool)
            mask[len(prompt) : len(prompt) + len(turn)] = True
            mask[len(tokens) - len(second) :] = True
            seqs.append(_sequence(tokens, mask, rng))
    long = rng.integers(0, VOCAB, 80).astype(np.int32)
    seqs.append(_sequence(long, np.arange(80) >= 50, rng))  # truncated to 64: tokens 50..63 trained
    late = rng.integers(0, VOCAB, 70).astype(np.int32)
    seqs.append(_sequence(late, np.arange(70) >= 66, rng))  # nothing sampled in the first 64: dropped
    return seqs


def _sequence(tokens: np.ndarray, mask: np.ndarray, rng: np.random.Generator) -> TrainSequence:
    behaviour = np.where(mask, rng.uniform(-5.0, -0.1, len(tokens)), 0.0).astype(np.float32)
    return TrainSequence(tokens, mask, behaviour, float(rng.normal()))


@pytest.mark.parametrize("share", [False, True], ids=["unshared", "shared-prefixes"])
def test_recorded_learner_logprobs_equal_an_independent_forward(mesh: jax.sharding.Mesh, share: bool) -> None:
    seqs = _groups()
    cfg = learner_config(64).model_copy(update={"share_prefixes": share})  # one row per micro-batch
    rl = rl_config(sampling=SamplingConfig(temperature=TEMPERATURE))
    learner = Learner(tiny_model(), rl, cfg, mesh)
    # The logprobs the loss used are the policy's before the update.
    expected = sequence_logprobs(learner.model(), [s.token_ids for s in seqs], TEMPERATURE)
    packed = learner.pack(seqs)
    assert len(packed.micro_batches) >= 3
    assert any(mb.tree for mb in packed.micro_batches) == share

    recorded = learner.update(packed).sequence_logprobs()

    assert len(recorded) == len(seqs)
    assert recorded[-1] is None  # dropped: no sampled token in what fits
    kept = cfg.length_buckets[-1]
    for seq, got, want in zip(seqs[:-1], recorded[:-1], expected[:-1], strict=True):
        assert got is not None and got.shape == (len(seq.token_ids),)
        trained = np.asarray(seq.loss_mask).copy()
        trained[kept:] = False  # the truncated tail is not trained
        assert np.all(np.isnan(got[~trained]))
        np.testing.assert_allclose(got[trained], want[trained], atol=1e-5, rtol=0)
    assert np.isnan(recorded[-2][kept:]).all() and np.isfinite(recorded[-2][50:kept]).all()


def test_train_step_metrics_are_the_update_s(mesh: jax.sharding.Mesh) -> None:
    seqs = _groups(5)[:-1]
    runs = []
    for keep in (False, True):
        learner = Learner(tiny_model(), rl_config(), learner_config(128), mesh)
        packed = learner.pack(seqs)
        runs.append(learner.update(packed).metrics if keep else learner.train_step(packed))
    assert runs[0] == runs[1]
