"""Qwen3-MoE sparse feed-forward: softmax router, top-k experts, grouped matmuls.

Tokens are sorted by chosen expert and run through `jax.lax.ragged_dot`, so the
cost scales with k (not with the number of experts) and no [tokens, experts]
dense dispatch tensor is built.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from legorl_jax.models.config import ModelConfig
from legorl_jax.models.linear import Linear

# lhs [tokens, in] grouped by expert along rows; rhs [expert, out, in].
_EXPERT_DOT = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(((1,), (2,)), ((), ())), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0]
)

# Per layer: how many times each expert was picked, and the summed router
# probability of each expert, over valid tokens; plus the valid-token count.
RouterStats = tuple[jax.Array, jax.Array, jax.Array]


class MoE(nnx.Module):
    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs) -> None:
        c = config
        e, d, i = c.num_experts, c.hidden_size, c.moe_intermediate_size
        self.gate = Linear(c, rngs, d, e, bias=False)
        # [expert, out, in]: each expert's matrix in HF layout (see Linear).
        init = nnx.initializers.lecun_normal(in_axis=-1, out_axis=-2, batch_axis=(0,))
        self.gate_proj = nnx.Param(init(rngs.params(), (e, i, d), c.param_dtype))
        self.up_proj = nnx.Param(init(rngs.params(), (e, i, d), c.param_dtype))
        self.down_proj = nnx.Param(init(rngs.params(), (e, d, i), c.param_dtype))
        self.top_k, self.norm_topk_prob, self.num_experts = c.num_experts_per_tok, c.norm_topk_prob, e
        self.compute_dtype = jnp.dtype(c.compute_dtype)

    def __call__(self, x: jax.Array, valid: jax.Array) -> tuple[jax.Array, RouterStats]:
        b, t, d = x.shape
        flat = x.reshape(b * t, d)
        probs = jax.nn.softmax(self.gate(flat).astype(jnp.float32), axis=-1)
        weights, experts = jax.lax.top_k(probs, self.top_k)
        if self.norm_topk_prob:
            weights = weights / weights.sum(axis=-1, keepdims=True)

        chosen = experts.reshape(-1)
        order = jnp.argsort(chosen)
        token_of = order // self.top_k
        group_sizes = jnp.bincount(chosen, length=self.num_experts).astype(jnp.int32)
        xs = flat[token_of].astype(self.compute_dtype)
        cd = self.compute_dtype

        def grouped(lhs: jax.Array, rhs: nnx.Param) -> jax.Array:
            return jax.lax.ragged_dot_general(lhs, rhs[...].astype(cd), group_sizes, _EXPERT_DOT)

        hidden = jax.nn.silu(grouped(xs, self.gate_proj)) * grouped(xs, self.up_proj)
        out = grouped(hidden, self.down_proj) * weights.reshape(-1)[order, None].astype(cd)
        y = jnp.zeros_like(flat, dtype=cd).at[token_of].add(out)

        v = valid.reshape(-1).astype(jnp.float32)
        counts = jnp.zeros(self.num_experts, jnp.float32).at[chosen].add(jnp.repeat(v, self.top_k))
        stats = (counts, (probs * v[:, None]).sum(axis=0), v.sum())
        return y.reshape(b, t, d), stats


def load_balancing_loss(stats: RouterStats, num_experts: int) -> jax.Array:
    """Switch-style aux loss over all layers (stats stacked on a leading layer axis).

    Matches transformers' `load_balancing_loss_func`: the expert-choice
    fraction and the mean router probability are each averaged over all
    layers' tokens before their product is summed; the caller applies
    `router_aux_loss_coef`.
    """
    counts, prob_sums, n_valid = stats
    total = jnp.maximum(n_valid.sum(), 1.0)
    return num_experts * jnp.sum((counts.sum(0) / total) * (prob_sums.sum(0) / total))
