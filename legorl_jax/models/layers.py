"""One decoder layer (attention + MLP or MoE) of the Qwen3 family.

The same layer code serves training (keys/values from the current tokens) and
inference (keys/values written into and read from a KV cache): the only
difference is where `k`/`v` come from before the attention call.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx

from legorl_jax.models.attention import attend, cached_attention
from legorl_jax.models.config import ModelConfig
from legorl_jax.models.kv_cache import LayerView, store_new
from legorl_jax.models.linear import Linear
from legorl_jax.models.moe import MoE, RouterStats
from legorl_jax.models.rope import apply_rope


def rms_norm(config: ModelConfig, rngs: nnx.Rngs, dim: int) -> nnx.RMSNorm:
    return nnx.RMSNorm(
        dim, epsilon=config.rms_norm_eps, dtype=config.compute_dtype, param_dtype=config.param_dtype, rngs=rngs
    )


class Attention(nnx.Module):
    """GQA self-attention with optional q/k RMSNorm (Qwen3) and q/k/v bias (Qwen2)."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs) -> None:
        c = config
        q_dim, kv_dim = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.q_proj = Linear(c, rngs, c.hidden_size, q_dim, c.qkv_bias)
        self.k_proj = Linear(c, rngs, c.hidden_size, kv_dim, c.qkv_bias)
        self.v_proj = Linear(c, rngs, c.hidden_size, kv_dim, c.qkv_bias)
        self.o_proj = Linear(c, rngs, q_dim, c.hidden_size, c.o_bias)
        self.q_norm = rms_norm(c, rngs, c.head_dim) if c.qk_norm else None
        self.k_norm = rms_norm(c, rngs, c.head_dim) if c.qk_norm else None
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.kernel = c.attention_kernel

    def __call__(
        self,
        x: jax.Array,
        rope: tuple[jax.Array, jax.Array],
        cache: LayerView | None,
        positions: jax.Array,
        segment_ids: jax.Array | None,
        kv_end: jax.Array | None = None,
    ) -> tuple[jax.Array, LayerView | None]:
        """x[B, T, D]. With a cache (inference) a query at position p sees the
        cache's positions 0..p, and the layer returns the cache with this step's
        keys and values written. Without one (training) segment_ids int32[B, T]
        pack the row and kv_end int32[B, T] makes it a trie (see `attend`).
        """
        b, t, _ = x.shape
        q = self.q_proj(x).reshape(b, t, self.num_heads, self.head_dim)
        k = self.k_proj(x).reshape(b, t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(b, t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        # The GQA head grouping is handled inside the kernel.
        if cache is not None:
            # Written first: a query reads its own position's key from the pool.
            k_pool = store_new(cache.k, cache.layer, cache.table, k, positions)
            v_pool = store_new(cache.v, cache.layer, cache.table, v, positions)
            cache = LayerView(k=k_pool, v=v_pool, layer=cache.layer, table=cache.table)
            out = cached_attention(q, cache, positions)
        else:
            assert segment_ids is not None  # a training step always brings its packing
            out = attend(q, k, v, segment_ids, kv_end, kernel=self.kernel)
        return self.o_proj(out.reshape(b, t, self.num_heads * self.head_dim)), cache


class MLP(nnx.Module):
    """SwiGLU feed-forward."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs) -> None:
        c, lin = config, partial(Linear, config, rngs)
        self.gate_proj = lin(c.hidden_size, c.intermediate_size, c.mlp_bias)
        self.up_proj = lin(c.hidden_size, c.intermediate_size, c.mlp_bias)
        self.down_proj = lin(c.intermediate_size, c.hidden_size, c.mlp_bias)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nnx.Module):
    """Pre-norm residual block; its parameters are stacked over layers by the model."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs) -> None:
        self.input_layernorm = rms_norm(config, rngs, config.hidden_size)
        self.self_attn = Attention(config, rngs=rngs)
        self.post_attention_layernorm = rms_norm(config, rngs, config.hidden_size)
        self.mlp: MLP | MoE = MoE(config, rngs=rngs) if config.is_moe else MLP(config, rngs=rngs)

    def __call__(
        self,
        x: jax.Array,
        rope: tuple[jax.Array, jax.Array],
        cache: LayerView | None,
        positions: jax.Array,
        valid: jax.Array,
        segment_ids: jax.Array | None,
        kv_end: jax.Array | None = None,
    ) -> tuple[jax.Array, LayerView | None, RouterStats | None]:
        """valid bool[B, T] marks real (non-padding) tokens for router statistics."""
        attn, cache = self.self_attn(self.input_layernorm(x), rope, cache, positions, segment_ids, kv_end)
        x = x + attn
        h = self.post_attention_layernorm(x)
        if isinstance(self.mlp, MoE):
            out, stats = self.mlp(h, valid)
            return x + out, cache, stats
        return x + self.mlp(h), cache, None


def segment_positions(segment_ids: jax.Array) -> jax.Array:
    """int32[B, T]: each token's index within its (contiguous) segment."""
    t = segment_ids.shape[1]
    idx = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), segment_ids.shape)
    starts = jnp.concatenate(
        [jnp.ones_like(segment_ids[:, :1], bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1
    )
    first = jax.lax.cummax(jnp.where(starts, idx, 0), axis=1)
    return idx - first
