"""Micro-batches sized by the step's rows train exactly what the fixed full-row
shapes trained (loss, gradients, per-token logprobs; every aggregation mode,
plain and tree rows), and a run of varying step sizes compiles few programs."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from tiny import harness_groups, learner_config, random_sequences, rl_config, tiny_model

from legorl_jax.core.config import LearnerConfig, MeshConfig
from legorl_jax.rl.batching import row_counts
from legorl_jax.train.sharding import learner_mesh
from legorl_jax.train.step import Learner

BUCKETS = [32, 64]


@pytest.fixture(scope="module")
def mesh() -> jax.sharding.Mesh:
    return learner_mesh(MeshConfig())


def _config(budget: int, share: bool) -> LearnerConfig:
    return learner_config(budget).model_copy(update={"length_buckets": BUCKETS, "share_prefixes": share})


def _train(mesh: jax.sharding.Mesh, share: bool, fit_rows: bool, aggregation: str) -> dict:
    learner = Learner(tiny_model(), rl_config(aggregation=aggregation, kl_coef=0.05), _config(384, share), mesh)
    packed = learner.pack(harness_groups() + random_sequences(3, 6, 24), fit_rows=fit_rows)
    grads, numerator, _ = learner.accumulate(packed)
    result = learner.update(packed)
    return {
        "shapes": [(mb.tokens.shape, mb.tree) for mb in packed.micro_batches],
        "slots": sum(mb.tokens.size for mb in packed.micro_batches),
        "normaliser": packed.normaliser,
        "numerator": float(numerator),
        "grads": jax.device_get(grads),
        "metrics": result.metrics,
        "logprobs": result.sequence_logprobs(),
    }


def _rel_norm(a: object, b: object) -> float:
    """‖a − b‖ / ‖b‖ over every leaf: a batch of another size sums rows in another
    order, so single elements differ by float32 rounding of the order of 1e-6."""
    pairs = list(zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))
    diff = sum(float(np.sum((np.asarray(x) - y) ** 2)) for x, y in pairs)
    return float(np.sqrt(diff / sum(float(np.sum(np.square(y))) for _, y in pairs)))


# About 25 s each on a shared 2-core CPU: one plain and one tree case stay in the quick tier.
CASES = [
    pytest.param(False, "token_mean", marks=pytest.mark.slow),
    (False, "seq_mean_token_mean"),
    pytest.param(False, "constant", marks=pytest.mark.slow),
    pytest.param(True, "token_mean", marks=pytest.mark.slow),
    pytest.param(True, "seq_mean_token_mean", marks=pytest.mark.slow),
    (True, "constant"),
]


@pytest.mark.parametrize(("share", "aggregation"), CASES, ids=lambda v: {False: "plain", True: "tree"}.get(v, v))
def test_fitted_rows_train_exactly_what_full_rows_train(mesh: jax.sharding.Mesh, share: bool, aggregation: str) -> None:
    fitted, full = _train(mesh, share, True, aggregation), _train(mesh, share, False, aggregation)
    # Same micro-batches and buckets, fewer padding rows in the small ones.
    assert [s[1:] for s, _ in fitted["shapes"]] == [s[1:] for s, _ in full["shapes"]]
    assert fitted["slots"] < full["slots"]
    assert any(tree for _, tree in full["shapes"]) == share
    assert fitted["normaliser"] == full["normaliser"]
    assert fitted["numerator"] == pytest.approx(full["numerator"], rel=1e-6)
    assert fitted["metrics"]["loss"] == pytest.approx(full["metrics"]["loss"], rel=1e-6)
    assert _rel_norm(fitted["grads"], full["grads"]) <= 1e-6
    for key in ("grad_norm", "ratio_mean", "entropy", "tokens", "kl"):
        assert fitted["metrics"][key] == pytest.approx(full["metrics"][key], rel=1e-6, abs=1e-9), key
    for a, b in zip(fitted["logprobs"], full["logprobs"], strict=True):
        assert a is not None and b is not None
        trained = ~np.isnan(b)
        assert np.array_equal(np.isnan(a), ~trained) and trained.any()
        assert np.max(np.abs(a[trained] - b[trained]) / np.abs(b[trained])) <= 1e-6


def test_a_run_of_varying_step_sizes_compiles_few_micro_steps(mesh: jax.sharding.Mesh) -> None:
    budget = 512
    learner = Learner(tiny_model(), rl_config(), _config(budget, share=False), mesh)
    allowed = {(n, b) for b in BUCKETS for n in row_counts(b, budget, 1)}
    sizes = range(1, 25)
    seen = set()
    for n in sizes:
        packed = learner.pack(random_sequences(n, n))
        seen |= {mb.tokens.shape for mb in packed.micro_batches}
        learner.accumulate(packed)
    assert seen <= allowed and len(allowed) == 9 < len(sizes)
    # One compiled micro-step per shape seen: the bound holds for what XLA actually built.
    assert learner._micro._cache_size() == len(seen)
