"""Policy losses: pure per-token functions behind one signature, plus the shared
corrections every loss gets (TIS, MIS, KL to a reference).

Every loss is `loss_fn(inputs: PolicyInputs, cfg: RLConfig) -> (per_token_loss,
token_metrics)`. Arrays are aligned on *predicted* tokens: position t holds the
learner's log π_θ(y_t | y_<t), the engine's logprob of the same token, the
token's advantage and whether the token was sampled (loss_mask). Tokens of one
sequence share a `seq_ids` value so sequence-level quantities (GSPO's ratio,
MIS) reduce with a segment sum; sequences never straddle micro-batches.

The importance ratio is taken against the **engine's** behaviour logprobs, so it
covers both policy lag and engine-vs-learner numerical mismatch. Aggregation
(how per-token losses become one number) lives in `aggregation.py`: the loss
returns unweighted per-token values and the step multiplies by the weights.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from legorl_jax.core.config import RLConfig
from legorl_jax.core.registry import Registry

Array = jax.Array


class PolicyInputs(NamedTuple):
    logprobs: Array  # f32[..., T]: learner log-probs, temperature applied; differentiable
    behavior_logprobs: Array  # f32[..., T]: engine log-probs of the same tokens
    advantages: Array  # f32[..., T]: the token's sequence advantage
    loss_mask: Array  # f32[..., T]: 1 on sampled tokens
    seq_ids: Array  # i32[..., T]: sequence index in [0, num_seqs)
    num_seqs: int  # static bound on the sequences in this batch


LossFn = Callable[[PolicyInputs, RLConfig], tuple[Array, dict[str, Array]]]
LOSSES: Registry[LossFn] = Registry("policy loss")
register_loss = LOSSES.register


def seq_sum(values: Array, inputs: PolicyInputs) -> Array:
    """Per-sequence sums of masked per-token values: f32[num_seqs]."""
    masked = (values * inputs.loss_mask).reshape(-1)
    return jax.ops.segment_sum(masked, inputs.seq_ids.reshape(-1), num_segments=inputs.num_seqs)


def per_token(seq_values: Array, inputs: PolicyInputs) -> Array:
    """Broadcasts a per-sequence value back onto that sequence's tokens."""
    return seq_values[inputs.seq_ids]


def masked_log_ratio(inputs: PolicyInputs) -> Array:
    # Prompt and padding tokens have no engine logprob; a zero log-ratio there
    # keeps exp() finite and the value inert under the mask.
    return jnp.where(inputs.loss_mask > 0, inputs.logprobs - inputs.behavior_logprobs, 0.0)


def truncate_ratio(ratio: Array, cfg: RLConfig) -> Array:
    """Token TIS: the ratio's value (and so its gradient weight) capped at tis_cap.

    r · sg(min(r, C) / r) has value min(r, C) and gradient min(r, C)·∇log π, so a
    token the engine found far less likely than the learner cannot dominate.
    """
    if cfg.tis_cap is None:
        return ratio
    return ratio * jax.lax.stop_gradient(jnp.minimum(ratio, cfg.tis_cap) / ratio)


def _clip_metrics(ratio: Array, adv: Array, cfg: RLConfig) -> dict[str, Array]:
    # The clip binds only where it removes the gradient: below 1-ε for negative
    # advantages, above 1+ε for positive ones.
    low = ((ratio < 1.0 - cfg.clip_low) & (adv < 0)).astype(jnp.float32)
    high = ((ratio > 1.0 + cfg.clip_high) & (adv > 0)).astype(jnp.float32)
    return {"clip_frac_low": low, "clip_frac_high": high}


def _clipped_surrogate(ratio: Array, adv: Array, cfg: RLConfig) -> Array:
    clipped = jnp.clip(ratio, 1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
    return -jnp.minimum(ratio * adv, clipped * adv)


@register_loss("ppo_clip")
def ppo_clip(inputs: PolicyInputs, cfg: RLConfig) -> tuple[Array, dict[str, Array]]:
    """PPO clipped surrogate with DAPO's decoupled clip range [1-ε_low, 1+ε_high]."""
    ratio = truncate_ratio(jnp.exp(masked_log_ratio(inputs)), cfg)
    loss = _clipped_surrogate(ratio, inputs.advantages, cfg)
    return loss, _clip_metrics(ratio, inputs.advantages, cfg)


@register_loss("gspo")
def gspo(inputs: PolicyInputs, cfg: RLConfig) -> tuple[Array, dict[str, Array]]:
    """GSPO (Zheng et al. 2025): one ratio per sequence, the geometric mean of its
    token ratios, clipped as a whole; every token of the sequence carries it."""
    lengths = jnp.maximum(seq_sum(jnp.ones_like(inputs.logprobs), inputs), 1.0)
    seq_log_ratio = seq_sum(masked_log_ratio(inputs), inputs) / lengths
    ratio = truncate_ratio(per_token(jnp.exp(seq_log_ratio), inputs), cfg)
    loss = _clipped_surrogate(ratio, inputs.advantages, cfg)
    return loss, _clip_metrics(ratio, inputs.advantages, cfg)


@register_loss("cispo")
def cispo(inputs: PolicyInputs, cfg: RLConfig) -> tuple[Array, dict[str, Array]]:
    """CISPO (MiniMax-M1): REINFORCE on log π weighted by the clipped, stop-gradient
    IS ratio, so clipped tokens still contribute a gradient. The clip range is
    [1-clip_low, 1+clip_high]; MiniMax-M1 clips only above (clip_low >= 1)."""
    ratio = truncate_ratio(jnp.exp(masked_log_ratio(inputs)), cfg)
    weight = jax.lax.stop_gradient(jnp.clip(ratio, 1.0 - cfg.clip_low, 1.0 + cfg.clip_high))
    loss = -weight * inputs.advantages * inputs.logprobs
    return loss, _clip_metrics(ratio, inputs.advantages, cfg)


@register_loss("nll")
def nll(inputs: PolicyInputs, cfg: RLConfig) -> tuple[Array, dict[str, Array]]:
    """Supervised fine-tuning (`legorl sft`): the negative log-likelihood of the loss-mask
    tokens, with no advantage and no ratio (behaviour logprobs are not read)."""
    return -inputs.logprobs, {}


def kl_penalty(logprobs: Array, ref_logprobs: Array, estimator: str) -> Array:
    """Schulman's estimators of KL(π_θ ‖ π_ref) from samples of π_θ."""
    log_r = ref_logprobs - logprobs
    if estimator == "k1":
        return -log_r
    if estimator == "k2":
        return 0.5 * log_r**2
    if estimator == "k3":
        return jnp.exp(log_r) - log_r - 1.0
    raise ValueError(f"unknown kl_estimator {estimator!r}; valid: k1, k2, k3")


def mis_keep(inputs: PolicyInputs, cfg: RLConfig) -> Array:
    """Sequence MIS: 1 on tokens of sequences whose engine→learner IS weight
    Π_t π_θ/μ is at most mis_cap, 0 on rejected sequences (masked, not reweighted)."""
    if cfg.mis_cap is None:
        return jnp.ones_like(inputs.loss_mask)
    seq_log_weight = seq_sum(jax.lax.stop_gradient(masked_log_ratio(inputs)), inputs)
    keep = (seq_log_weight <= jnp.log(cfg.mis_cap)).astype(jnp.float32)
    return per_token(keep, inputs)


def policy_loss(
    inputs: PolicyInputs, cfg: RLConfig, ref_logprobs: Array | None = None
) -> tuple[Array, dict[str, Array]]:
    """The configured loss with MIS and KL applied; masked per-token loss and
    per-token metric values (reduce both with the batch's loss weights/mask)."""
    loss, metrics = LOSSES.get(cfg.loss)(inputs, cfg)
    keep = mis_keep(inputs, cfg)
    loss = loss * keep
    if cfg.kl_coef > 0:
        if ref_logprobs is None:
            raise ValueError("rl.kl_coef > 0 needs reference logprobs")
        kl = kl_penalty(inputs.logprobs, ref_logprobs, cfg.kl_estimator)
        loss = loss + cfg.kl_coef * kl
        metrics["kl"] = jax.lax.stop_gradient(kl)
    metrics["mis_rejected_frac"] = 1.0 - keep
    return loss * inputs.loss_mask, {k: jax.lax.stop_gradient(v) for k, v in metrics.items()}
