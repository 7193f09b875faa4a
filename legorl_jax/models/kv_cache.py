"""Per-slot KV cache for the inference engine (continuous batching).

Row b of the cache is one sequence slot; slot index == token position, so a row
holds positions 0..max_len-1 of whatever sequence the engine put there. The
cache is a plain pytree of fixed-shape arrays: every decode step has the same
shapes and compiles once.

Stale entries are harmless: a query at position p only reads slots 0..p, and
a sequence that takes over a row writes those slots (prefill from position 0)
before any query reads them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from legorl_jax.models.config import ModelConfig

PAD_POSITION = -1  # a token at this position is padding: not written, not attended


@struct.dataclass
class KVCache:
    """k, v: [layers, batch, max_len, kv_heads, head_dim]."""

    k: jax.Array
    v: jax.Array

    @property
    def max_len(self) -> int:
        return self.k.shape[2]


def init_kv_cache(config: ModelConfig, batch: int, max_len: int, dtype: jnp.dtype | str | None = None) -> KVCache:
    """An all-zero cache; dtype defaults to the model's compute dtype."""
    if batch <= 0 or max_len <= 0:
        raise ValueError(f"init_kv_cache: batch and max_len must be positive, got {batch}, {max_len}")
    shape = (config.num_layers, batch, max_len, config.num_kv_heads, config.head_dim)
    dtype = jnp.dtype(dtype or config.compute_dtype)
    return KVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))


def write_layer(cache: jax.Array, new: jax.Array, positions: jax.Array) -> jax.Array:
    """Store new[B, T, K, D] at cache[b, positions[b, t]] for one layer's cache[B, S, K, D].

    Padding positions (-1) are redirected past the end and dropped, because a
    negative index would wrap around and overwrite the last slot.
    """
    max_len = cache.shape[1]
    slots = jnp.where(positions < 0, max_len, positions)
    rows = jnp.arange(cache.shape[0])[:, None]
    return cache.at[rows, slots].set(new.astype(cache.dtype), mode="drop")


def cache_mask(positions: jax.Array, max_len: int) -> jax.Array:
    """bool[B, 1, T, S]: query at position p sees slots 0..p of its own row.

    A padding query sees slot 0 only, so its softmax has a finite denominator
    (its output is ignored either way).
    """
    slots = jnp.arange(max_len)[None, None, :]
    q = jnp.where(positions < 0, 0, positions)[:, :, None]
    return (slots <= q)[:, None]
