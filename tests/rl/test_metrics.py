"""Step metrics merged over micro-batches equal the metrics of the whole batch."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from legorl_jax.core.config import RLConfig
from legorl_jax.rl.losses import PolicyInputs, policy_loss
from legorl_jax.rl.metrics import finalize, merge, micro_batch_metrics


def _inputs(rng: np.random.Generator, rows: int) -> PolicyInputs:
    behav = -rng.exponential(1.0, (rows, 16))
    logp = behav + rng.normal(0, 0.4, (rows, 16))
    mask = (rng.random((rows, 16)) < 0.6).astype(np.float32)
    adv = np.repeat(rng.normal(size=(rows, 1)), 16, axis=1)
    seq = np.repeat(np.arange(rows)[:, None], 16, axis=1)
    return PolicyInputs(*(jnp.asarray(a, jnp.float32) for a in (logp, behav, adv, mask)), jnp.asarray(seq), rows)


def test_merged_micro_batch_metrics_match_numpy() -> None:
    rng = np.random.default_rng(3)
    cfg = RLConfig(clip_low=0.2, clip_high=0.2, tis_cap=None)
    parts = [_inputs(rng, r) for r in (2, 3)]
    acc = None
    for inp in parts:
        _, token_metrics = policy_loss(inp, cfg)
        m = micro_batch_metrics(inp, token_metrics)
        acc = m if acc is None else merge(acc, m)
    got = finalize(acc)

    cat = lambda f: np.concatenate([np.asarray(getattr(p, f)).ravel() for p in parts])  # noqa: E731
    mask = cat("loss_mask") > 0
    logp, behav, adv = cat("logprobs")[mask], cat("behavior_logprobs")[mask], cat("advantages")[mask]
    ratio = np.exp(logp - behav)
    assert got["tokens"] == mask.sum()
    assert got["ratio_mean"] == pytest.approx(ratio.mean(), rel=1e-5)
    assert got["ratio_max"] == pytest.approx(ratio.max(), rel=1e-5)
    assert got["logprob_diff_mean"] == pytest.approx(np.abs(logp - behav).mean(), rel=1e-5)
    assert got["logprob_diff_max"] == pytest.approx(np.abs(logp - behav).max(), rel=1e-5)
    assert got["prob_diff_mean"] == pytest.approx(np.abs(np.exp(logp) - np.exp(behav)).mean(), rel=1e-4)
    assert got["entropy"] == pytest.approx(-logp.mean(), rel=1e-5)
    assert got["clip_frac_high"] == pytest.approx(((ratio > 1.2) & (adv > 0)).mean(), abs=1e-7)
    assert got["clip_frac_low"] == pytest.approx(((ratio < 0.8) & (adv < 0)).mean(), abs=1e-7)
    assert got["mis_rejected_frac"] == 0.0
