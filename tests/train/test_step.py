"""The train step on one CPU device: exact accumulation, temperature parity with
the engine, KL reference, and that updates move the objective."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from tiny import learner_config, random_sequences, rl_config, sequence_logprobs, tiny_model

from legorl_jax.core.config import MeshConfig, SamplingConfig
from legorl_jax.rl.batching import TrainSequence
from legorl_jax.train.sharding import learner_mesh
from legorl_jax.train.step import Learner


@pytest.fixture(scope="module")
def mesh() -> jax.sharding.Mesh:
    return learner_mesh(MeshConfig())


def _max_rel(a: dict, b: dict) -> float:
    return max(
        float(np.max(np.abs(x - y)) / (np.max(np.abs(y)) + 1e-12))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


def test_k_micro_batches_equal_one_batch(mesh: jax.sharding.Mesh) -> None:
    seqs = random_sequences(1, 16)
    runs = {}
    for budget in (64, 1024):
        rl = rl_config(kl_coef=0.05, aggregation="seq_mean_token_mean")
        learner = Learner(tiny_model(), rl, learner_config(budget), mesh)
        packed = learner.pack(seqs)
        grads, numerator, _ = learner.accumulate(packed)
        metrics = learner.train_step(packed)
        params = jax.device_get(learner.params)
        runs[budget] = (len(packed.micro_batches), float(numerator), jax.device_get(grads), params, metrics)
    (k, num_k, g_k, p_k, m_k), (one, num_1, g_1, p_1, m_1) = runs[64], runs[1024]
    assert k >= 4 and one <= 2
    assert num_k == pytest.approx(num_1, rel=1e-5)
    assert _max_rel(g_k, g_1) < 1e-5
    assert _max_rel(p_k, p_1) < 1e-5
    assert m_k["grad_norm"] == pytest.approx(m_1["grad_norm"], rel=1e-5)
    assert m_k["tokens"] == m_1["tokens"] == sum(int(s.loss_mask.sum()) for s in seqs)


def _engine_sequences(model, temperature: float, n: int = 6) -> list[TrainSequence]:
    """Sequences whose behaviour logprobs are the model's own at `temperature`,
    standing in for an engine that serves exactly the learner's weights."""
    rng = np.random.default_rng(11)
    tokens = [rng.integers(0, 128, int(rng.integers(8, 30))).astype(np.int32) for _ in range(n)]
    out = []
    for t, lp in zip(tokens, sequence_logprobs(model, tokens, temperature), strict=True):
        mask = np.arange(len(t)) >= 3
        out.append(TrainSequence(t, mask, lp * mask, 1.0))
    return out


def test_learner_applies_the_engine_temperature(mesh: jax.sharding.Mesh) -> None:
    model = tiny_model()
    seqs = _engine_sequences(model, temperature=0.7)
    matched = Learner(model, rl_config(sampling=SamplingConfig(temperature=0.7)), learner_config(), mesh)
    m = matched.train_step(matched.pack(seqs))
    assert m["logprob_diff_max"] < 1e-4 and m["ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    assert m["clip_frac_low"] == m["clip_frac_high"] == 0.0
    unmatched = Learner(tiny_model(), rl_config(), learner_config(), mesh)
    assert unmatched.train_step(unmatched.pack(seqs))["logprob_diff_max"] > 1e-2


def test_kl_to_the_initial_policy(mesh: jax.sharding.Mesh) -> None:
    learner = Learner(tiny_model(), rl_config(kl_coef=0.1, kl_estimator="k3"), learner_config(), mesh)
    packed = learner.pack(random_sequences(2))
    first = learner.train_step(packed)
    second = learner.train_step(packed)
    assert first["kl"] == pytest.approx(0.0, abs=1e-7)  # the reference is the starting policy
    assert second["kl"] > 1e-6
    no_kl = Learner(tiny_model(), rl_config(), learner_config(), mesh)
    assert "kl" not in no_kl.train_step(packed) and no_kl.ref_params is None


@pytest.mark.parametrize("loss", ["ppo_clip", "gspo", "cispo"])
def test_steps_raise_the_likelihood_of_advantaged_tokens(mesh: jax.sharding.Mesh, loss: str) -> None:
    model = tiny_model()
    seqs = _engine_sequences(model, temperature=1.0)
    seqs = [
        TrainSequence(s.token_ids, s.loss_mask, s.behavior_logprobs, a) for s, a in zip(seqs, [1, -1] * 3, strict=True)
    ]
    learner = Learner(model, rl_config(loss=loss, clip_low=0.5, clip_high=0.5), learner_config(lr=3e-3), mesh)
    packed = learner.pack(seqs)
    for _ in range(4):
        learner.train_step(packed)
    after = sequence_logprobs(learner.model(), [s.token_ids for s in seqs])
    for s, lp in zip(seqs, after, strict=True):
        change = (lp - s.behavior_logprobs)[s.loss_mask].sum()
        assert np.sign(change) == np.sign(s.advantage), (loss, s.advantage, change)


def test_moe_router_loss_is_trained(mesh: jax.sharding.Mesh) -> None:
    moe = dict(architecture="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
    losses = []
    for coef in (0.0, 0.5):
        learner = Learner(tiny_model(router_aux_loss_coef=coef, **moe), rl_config(), learner_config(), mesh)
        packed = learner.pack(random_sequences(4))
        grads, numerator, _ = learner.accumulate(packed)
        losses.append(float(numerator) / packed.normaliser)
    # Same weights (same seed): the difference is coef × the load-balancing loss
    # E·Σ f_i·P_i, which near-uniform routing at init puts close to k = 2.
    assert losses[1] - losses[0] == pytest.approx(0.5 * 2, rel=0.2)


def test_update_ratio_is_how_far_the_step_moved_the_weights(mesh: jax.sharding.Mesh) -> None:
    learner = Learner(tiny_model(), rl_config(), learner_config(), mesh)
    packed = learner.pack(random_sequences(3))
    before = jax.device_get(learner.params)
    metrics = learner.train_step(packed)
    after = jax.device_get(learner.params)
    pairs = zip(jax.tree.leaves(after), jax.tree.leaves(before), strict=True)
    moved = np.sqrt(sum(float(np.sum((a - b) ** 2)) for a, b in pairs))
    norm = np.sqrt(sum(float(np.sum(b**2)) for b in jax.tree.leaves(before)))
    assert metrics["update_ratio"] > 0
    assert metrics["update_ratio"] == pytest.approx(moved / norm, rel=1e-3)
