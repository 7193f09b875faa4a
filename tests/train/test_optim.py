"""The optimizer chain: schedule shape, global-norm clipping, decoupled weight decay."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from legorl_jax.core.config import OptimizerConfig
from legorl_jax.train.optim import build_optimizer, learning_rate_schedule


def test_warmup_then_cosine_and_linear_decay() -> None:
    cos = learning_rate_schedule(OptimizerConfig(learning_rate=1.0, warmup_steps=4, schedule="cosine", total_steps=14))
    assert [float(cos(s)) for s in (0, 2, 4)] == pytest.approx([0.0, 0.5, 1.0])
    assert float(cos(9)) == pytest.approx(0.5 * (1 + np.cos(np.pi * 5 / 10)))
    assert float(cos(14)) == pytest.approx(0.0, abs=1e-7)
    lin = learning_rate_schedule(OptimizerConfig(learning_rate=2.0, schedule="linear", total_steps=10))
    assert [float(lin(s)) for s in (0, 5, 10)] == pytest.approx([2.0, 1.0, 0.0])
    const = learning_rate_schedule(OptimizerConfig(learning_rate=0.3, warmup_steps=2))
    assert [float(const(s)) for s in (1, 2, 100)] == pytest.approx([0.15, 0.3, 0.3])


def test_decay_ends_at_the_final_fraction_of_the_peak() -> None:
    """`final_lr_fraction` is the floor: the demo SFT's warm-up + cosine to a twentieth of the peak."""
    import optax

    cfg = OptimizerConfig(learning_rate=3e-3, warmup_steps=20, schedule="cosine", total_steps=900)
    floored = learning_rate_schedule(cfg.model_copy(update={"final_lr_fraction": 0.05}))
    demo = optax.warmup_cosine_decay_schedule(0.0, 3e-3, 20, 900, end_value=3e-3 / 20)
    steps = np.arange(0, 901, 7)
    np.testing.assert_allclose([float(floored(s)) for s in steps], [float(demo(s)) for s in steps], rtol=1e-5)
    half = OptimizerConfig(learning_rate=2.0, schedule="linear", total_steps=10, final_lr_fraction=0.5)
    lin = learning_rate_schedule(half)
    assert [float(lin(s)) for s in (0, 5, 10)] == pytest.approx([2.0, 1.5, 1.0])


def test_first_update_is_clipped_adam_with_weight_decay() -> None:
    # A large eps makes Adam's step depend on the gradient's scale, so clipping shows.
    cfg = OptimizerConfig(learning_rate=0.1, grad_clip_norm=1.0, weight_decay=0.5, eps=1.0)
    tx = build_optimizer(cfg)
    params = {"w": jnp.array([1.0, -2.0])}
    grads = {"w": jnp.array([30.0, -40.0])}  # norm 50: clipped to (0.6, -0.8)
    updates, _ = tx.update(grads, tx.init(params), params)
    clipped = np.array([0.6, -0.8])
    # first bias-corrected Adam step: m̂ = g, v̂ = g², so g / (|g| + eps); AdamW adds wd·p
    expected = -0.1 * (clipped / (np.abs(clipped) + 1.0) + 0.5 * np.array([1.0, -2.0]))
    np.testing.assert_allclose(np.asarray(updates["w"]), expected, rtol=1e-5)
