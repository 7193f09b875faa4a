"""Policy losses, corrections and aggregation against an independent NumPy
transcription of each published formula, evaluated sequence by sequence.

The NumPy side never sees packed layouts or segment sums: it loops over
sequences, so agreement also checks the JAX side's sequence bookkeeping.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from legorl_jax.core.config import RLConfig
from legorl_jax.core.registry import UnknownNameError
from legorl_jax.rl.batching import MicroBatch, TrainSequence, pack_step
from legorl_jax.rl.losses import LOSSES, PolicyInputs, policy_loss

jax.config.update("jax_enable_x64", False)


@dataclass
class Seq:
    logp: np.ndarray  # learner logprob per token (index 0 unused: no context)
    behav: np.ndarray
    mask: np.ndarray
    adv: float
    ref: np.ndarray


def _random_seqs(rng: np.random.Generator, n: int) -> list[Seq]:
    out = []
    for _ in range(n):
        length = int(rng.integers(3, 40))
        behav = -rng.exponential(1.0, size=length)
        logp = np.minimum(behav + rng.normal(0.0, 0.35, size=length), -1e-3)
        mask = rng.random(length) < 0.7
        mask[0] = False
        mask[int(rng.integers(1, length))] = True
        ref = np.minimum(logp + rng.normal(0, 0.2, size=length), -1e-3)
        out.append(Seq(logp, behav, mask, float(rng.normal()), ref))
    return out


def _np_token_terms(s: Seq, cfg: RLConfig) -> tuple[np.ndarray, np.ndarray]:
    """(per-token loss value, d loss / d logp) over the sequence's sampled tokens."""
    m = s.mask
    lo, hi, a = 1 - cfg.clip_low, 1 + cfg.clip_high, s.adv
    cap = np.inf if cfg.tis_cap is None else cfg.tis_cap
    r = np.exp(s.logp[m] - s.behav[m])
    n = m.sum()
    if cfg.loss == "gspo":
        seq_r = np.exp(np.mean(s.logp[m] - s.behav[m]))  # geometric mean of token ratios
        rt = min(seq_r, cap) * np.ones(n)
        unclipped = rt * a <= np.clip(rt, lo, hi) * a
        loss = -np.minimum(rt * a, np.clip(rt, lo, hi) * a)
        # every token carries the sequence term, so d(Σ_j loss_j)/d logp_t = n · (-a·s/n)
        grad = np.where(unclipped, -a * rt, 0.0)
    elif cfg.loss == "ppo_clip":
        rt = np.minimum(r, cap)
        loss = -np.minimum(rt * a, np.clip(rt, lo, hi) * a)
        grad = np.where(rt * a <= np.clip(rt, lo, hi) * a, -a * rt, 0.0)
    else:  # cispo: -sg(clip(r)) A log π
        w = np.clip(np.minimum(r, cap), lo, hi)
        loss = -w * a * s.logp[m]
        grad = -w * a
    if cfg.mis_cap is not None and np.prod(np.exp(s.logp[m] - s.behav[m])) > cfg.mis_cap:
        loss, grad = 0 * loss, 0 * grad
    if cfg.kl_coef > 0:
        d = s.ref[m] - s.logp[m]
        kl, dkl = {
            "k1": (-d, np.ones(n)),
            "k2": (0.5 * d**2, -d),
            "k3": (np.exp(d) - d - 1, -np.exp(d) + 1),
        }[cfg.kl_estimator]
        loss, grad = loss + cfg.kl_coef * kl, grad + cfg.kl_coef * dkl
    return loss, grad


def _np_objective(seqs: list[Seq], cfg: RLConfig, const: float) -> tuple[float, list[np.ndarray]]:
    terms = [_np_token_terms(s, cfg) for s in seqs]
    if cfg.aggregation == "token_mean":
        total = sum(s.mask.sum() for s in seqs)
        scale = [1.0 / total] * len(seqs)
    elif cfg.aggregation == "seq_mean_token_mean":
        scale = [1.0 / (s.mask.sum() * len(seqs)) for s in seqs]
    else:
        scale = [1.0 / (const * len(seqs))] * len(seqs)
    value = sum(k * loss.sum() for k, (loss, _) in zip(scale, terms, strict=True))
    return float(value), [k * g for k, (_, g) in zip(scale, terms, strict=True)]


def _as_train(seqs: list[Seq], field: str) -> list[TrainSequence]:
    """Test instrument: packs one per-token field in the `behavior_logprobs` slot, so
    packing (deterministic) lays learner/reference logprobs out like the batch."""
    return [TrainSequence(np.arange(len(s.mask), dtype=np.int32), s.mask, getattr(s, field), s.adv) for s in seqs]


def _jax_objective(seqs: list[Seq], cfg: RLConfig) -> tuple[float, list[np.ndarray], float]:
    kw = dict(buckets=[16, 64], micro_batch_tokens=256, aggregation=cfg.aggregation, max_segments=4)
    step = pack_step(_as_train(seqs, "behav"), **kw)
    learner = pack_step(_as_train(seqs, "logp"), **kw)
    ref = pack_step(_as_train(seqs, "ref"), **kw)
    total, grads = 0.0, []
    for mb, lmb, rmb in zip(step.micro_batches, learner.micro_batches, ref.micro_batches, strict=True):

        def objective(logp: jax.Array, mb: MicroBatch = mb, rmb: MicroBatch = rmb) -> jax.Array:
            inputs = PolicyInputs(
                logp,
                jnp.asarray(mb.behavior_logprobs),
                jnp.asarray(mb.advantages),
                jnp.asarray(mb.loss_mask),
                jnp.asarray(mb.seq_ids),
                mb.num_seqs,
            )
            loss, _ = policy_loss(inputs, cfg, jnp.asarray(rmb.behavior_logprobs))
            return jnp.sum(loss * mb.loss_weight) / step.normaliser

        value, grad = jax.value_and_grad(objective)(jnp.asarray(lmb.behavior_logprobs))
        total += float(value)
        grads.append((np.asarray(grad), mb))
    return total, grads, step.normaliser


@pytest.mark.parametrize("loss", ["ppo_clip", "gspo", "cispo"])
@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean", "constant"])
@pytest.mark.parametrize("corrections", [dict(), dict(tis_cap=1.1, mis_cap=3.0, kl_coef=0.1, kl_estimator="k3")])
def test_loss_value_and_gradient_match_numpy(loss: str, aggregation: str, corrections: dict) -> None:
    base = dict(tis_cap=None, mis_cap=None, kl_coef=0.0)
    cfg = RLConfig(loss=loss, aggregation=aggregation, clip_low=0.2, clip_high=0.28, **{**base, **corrections})
    seqs = _random_seqs(np.random.default_rng(zlib.crc32(f"{loss}{aggregation}{corrections}".encode())), 24)
    got, grads, _ = _jax_objective(seqs, cfg)
    want, want_grads = _np_objective(seqs, cfg, const=64.0)
    assert got == pytest.approx(want, rel=2e-5, abs=1e-7)
    # Token-order check: the packer places each row's sequences contiguously, so
    # compare the multiset of per-token gradients (sorted), which any misplaced
    # ratio, weight or sequence reduction would change.
    flat = np.concatenate([g[mb.loss_mask > 0] for g, mb in grads])
    np.testing.assert_allclose(np.sort(flat), np.sort(np.concatenate(want_grads)), rtol=2e-4, atol=1e-8)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_estimators(estimator: str) -> None:
    cfg = RLConfig(loss="cispo", tis_cap=None, kl_coef=0.5, kl_estimator=estimator)
    seqs = _random_seqs(np.random.default_rng(7), 10)
    got, _, _ = _jax_objective(seqs, cfg)
    assert got == pytest.approx(_np_objective(seqs, cfg, 64.0)[0], rel=2e-5)


def test_tis_caps_the_gradient_weight() -> None:
    cfg = RLConfig(loss="ppo_clip", clip_low=10.0, clip_high=10.0, tis_cap=1.5)
    logp = jnp.array([[0.0, -0.1, -0.2]])
    behav = jnp.array([[0.0, -2.0, -0.2]])  # ratio e^1.9 ≈ 6.7 on token 1
    mask = jnp.array([[0.0, 1.0, 1.0]])
    adv = jnp.full((1, 3), -1.0)

    def f(lp: jax.Array) -> jax.Array:
        loss, _ = policy_loss(PolicyInputs(lp, behav, adv, mask, jnp.zeros((1, 3), jnp.int32), 1), cfg)
        return loss.sum()

    g = jax.grad(f)(logp)
    np.testing.assert_allclose(np.asarray(g), [[0.0, 1.5, 1.0]], rtol=1e-6)


def test_kl_without_reference_is_an_error() -> None:
    cfg = RLConfig(kl_coef=0.1)
    z = jnp.zeros((1, 3))
    with pytest.raises(ValueError, match="reference logprobs"):
        policy_loss(PolicyInputs(z, z, z, z, jnp.zeros((1, 3), jnp.int32), 1), cfg)


def test_unknown_loss_name_lists_the_valid_ones() -> None:
    cfg = RLConfig(loss="reinforce")
    z = jnp.zeros((1, 3))
    with pytest.raises(UnknownNameError, match="cispo, gspo, nll, ppo_clip"):
        policy_loss(PolicyInputs(z, z, z, z, jnp.zeros((1, 3), jnp.int32), 1), cfg)
    assert LOSSES.names() == ["cispo", "gspo", "nll", "ppo_clip"]
