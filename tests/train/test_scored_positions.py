"""The learner computes logprobs only at scored targets (`MicroBatch.score_index`) and trains exactly
what scoring every target trains: loss, gradients, metrics and the logprobs it hands back, for plain,
packed and prefix-shared (tree) rows, with and without a reference model."""

from __future__ import annotations

from dataclasses import replace

import jax
import numpy as np
import pytest
from tiny import VOCAB, harness_groups, learner_config, rl_config, tiny_model

from legorl_jax.core.config import MeshConfig
from legorl_jax.rl.batching import PackedStep, TrainSequence
from legorl_jax.train.sharding import learner_mesh
from legorl_jax.train.step import Learner


def _all_targets(packed: PackedStep) -> PackedStep:
    """The same step with every target scored: the LM head at every position."""
    return replace(packed, micro_batches=[replace(mb, score_index=None) for mb in packed.micro_batches])


def _sequences(seed: int = 0) -> list[TrainSequence]:
    """Prompt-heavy groups, plus a short sequence scored at every target but its first."""
    rng = np.random.default_rng(seed)
    n = 30
    whole = TrainSequence(
        rng.integers(0, VOCAB, n).astype(np.int32),
        np.arange(n) >= 1,
        np.full(n, -4.0, np.float32) * (np.arange(n) >= 1),
        0.7,
    )
    return [*harness_groups(seed, configs=2), whole]


def _step(learner: Learner, packed: PackedStep) -> dict:
    grads, numerator, _ = learner.accumulate(packed)
    result = learner.update(packed)
    pairs = zip(packed.micro_batches, result.logprobs, strict=True)
    logprobs = [np.where(mb.loss_mask > 0, np.asarray(lp), 0.0) for mb, lp in pairs]
    return {
        "grads": jax.device_get(grads),
        "numerator": float(numerator),
        "metrics": result.metrics,
        "logprobs": logprobs,
        "params": jax.device_get(learner.params),
    }


def _rel(a: object, b: object) -> float:
    return max(
        float(np.max(np.abs(np.asarray(x) - np.asarray(y))) / (np.max(np.abs(np.asarray(y))) + 1e-12))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


SLOW = pytest.mark.slow  # about 15 s each on a small CPU


@pytest.mark.parametrize(
    ("share", "kl_coef", "loss"),
    [
        (False, 0.1, "ppo_clip"),
        (True, 0.1, "ppo_clip"),
        pytest.param(False, 0.0, "ppo_clip", marks=SLOW),
        pytest.param(True, 0.0, "ppo_clip", marks=SLOW),
        pytest.param(True, 0.0, "nll", marks=SLOW),
    ],
)
def test_scored_targets_train_exactly_like_all_targets(share: bool, kl_coef: float, loss: str) -> None:
    mesh = learner_mesh(MeshConfig())
    # Rows of 256 tokens, each with several sequences (packed, or a shared-prefix tree) and few loss targets.
    cfg = learner_config(512).model_copy(update={"share_prefixes": share, "length_buckets": [256]})
    rl = rl_config(kl_coef=kl_coef, loss=loss)
    learner = Learner(tiny_model(), rl, cfg, mesh)
    packed = learner.pack(_sequences())
    assert all(mb.score_index is not None for mb in packed.micro_batches)
    assert any(mb.tree for mb in packed.micro_batches) == share
    scored = _step(learner, packed)
    full = _step(Learner(tiny_model(), rl, cfg, mesh), _all_targets(packed))
    assert scored["numerator"] == pytest.approx(full["numerator"], rel=1e-6)
    assert _rel(scored["grads"], full["grads"]) < 1e-5
    assert _rel(scored["params"], full["params"]) < 1e-5
    assert _rel(scored["logprobs"], full["logprobs"]) < 1e-6
    for key, value in full["metrics"].items():
        assert scored["metrics"][key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
