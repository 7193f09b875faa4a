"""Per-step learner metrics, accumulated exactly across micro-batches.

Each micro-batch yields sums (over sampled tokens) and maxima; sums add and
maxima max across micro-batches, and `finalize` divides once by the step's
sampled-token count. Entropy is the Monte-Carlo estimate E_y~π[-log π(y)] from
the sampled tokens' learner logprobs, which needs no [B, T, V] pass.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from legorl_jax.rl.losses import PolicyInputs, masked_log_ratio

Array = jax.Array
MetricAcc = dict[str, dict[str, Array]]


def micro_batch_metrics(inputs: PolicyInputs, token_metrics: dict[str, Array]) -> MetricAcc:
    mask = inputs.loss_mask
    logp = jax.lax.stop_gradient(inputs.logprobs)
    log_ratio = jax.lax.stop_gradient(masked_log_ratio(inputs))
    ratio = jnp.exp(log_ratio)
    abs_diff = jnp.abs(log_ratio)
    prob_diff = jnp.abs(jnp.exp(logp) - jnp.exp(inputs.behavior_logprobs)) * mask
    per_token = {
        **token_metrics,
        "ratio_mean": ratio,
        "logprob_diff_mean": abs_diff,
        "prob_diff_mean": prob_diff,
        "entropy": -logp,
    }
    sums = {k: jnp.sum(v * mask) for k, v in per_token.items()}
    sums["tokens"] = jnp.sum(mask)
    off_mask = jnp.where(mask > 0, 1.0, 0.0)
    maxes = {
        "ratio_max": jnp.max(ratio * off_mask),
        "logprob_diff_max": jnp.max(abs_diff * off_mask),
        "prob_diff_max": jnp.max(prob_diff),
    }
    return {"sum": sums, "max": maxes}


def merge(a: MetricAcc, b: MetricAcc) -> MetricAcc:
    return {
        "sum": jax.tree.map(jnp.add, a["sum"], b["sum"]),
        "max": jax.tree.map(jnp.maximum, a["max"], b["max"]),
    }


def finalize(acc: MetricAcc) -> dict[str, float]:
    """Host-side: token means, maxima and the sampled-token count."""
    acc = jax.device_get(acc)
    tokens = float(acc["sum"]["tokens"])
    out = {k: float(v) / max(tokens, 1.0) for k, v in acc["sum"].items() if k != "tokens"}
    out.update({k: float(v) for k, v in acc["max"].items()})
    out["tokens"] = tokens
    return out
