"""The learner's Optax chain: global-norm clip, then AdamW on a warm-up/decay schedule."""

from __future__ import annotations

import optax

from legorl_jax.core.config import OptimizerConfig


def learning_rate_schedule(cfg: OptimizerConfig) -> optax.Schedule:
    """Linear warm-up from 0 to the peak rate, then constant, cosine or linear decay
    to `final_lr_fraction` of the peak at `total_steps`."""
    decay_steps = max(cfg.total_steps - cfg.warmup_steps, 1)
    if cfg.schedule == "constant":
        after = optax.constant_schedule(cfg.learning_rate)
    elif cfg.schedule == "cosine":
        after = optax.cosine_decay_schedule(cfg.learning_rate, decay_steps, alpha=cfg.final_lr_fraction)
    else:
        after = optax.linear_schedule(cfg.learning_rate, cfg.learning_rate * cfg.final_lr_fraction, decay_steps)
    if cfg.warmup_steps == 0:
        return after
    warmup = optax.linear_schedule(0.0, cfg.learning_rate, cfg.warmup_steps)
    return optax.join_schedules([warmup, after], [cfg.warmup_steps])


def build_optimizer(cfg: OptimizerConfig) -> optax.GradientTransformation:
    return optax.chain(
        optax.clip_by_global_norm(cfg.grad_clip_norm),
        optax.adamw(
            learning_rate=learning_rate_schedule(cfg),
            b1=cfg.b1,
            b2=cfg.b2,
            eps=cfg.eps,
            weight_decay=cfg.weight_decay,
        ),
    )
