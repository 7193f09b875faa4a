"""KV cache for the inference engine: a pool of fixed-size blocks.

k, v are [layers, blocks, block_size, kv_heads, head_dim]. A step gives each
row a block table int32[B, N]: row b's position p lives in block
table[b, p // block_size] at offset p % block_size. The engine hands blocks
out (and shares prompt-prefix blocks between rows), so memory follows the
tokens actually held, and a step reads only the N blocks of its window.

The slot-per-row layout (`init_kv_cache(config, batch, max_len)`) is the same
pool read with one block of max_len positions per row: `decode` without a
block table.

Stale entries are harmless: a query at position p only reads positions 0..p,
and whoever owns a block writes its positions before any query reads them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from legorl_jax.models.config import ModelConfig

PAD_POSITION = -1  # a token at this position is padding: not written, not attended


@struct.dataclass
class KVCache:
    """k, v: [layers, blocks, block_size, kv_heads, head_dim]."""

    k: jax.Array
    v: jax.Array

    @property
    def block_size(self) -> int:
        return self.k.shape[2]

    @property
    def max_len(self) -> int:
        """Positions per row in the slot-per-row layout."""
        return self.block_size


def kv_bytes_per_token(config: ModelConfig, dtype: jnp.dtype | str | None = None) -> int:
    """Bytes of K and V one token takes over all layers."""
    itemsize = jnp.dtype(dtype or config.compute_dtype).itemsize
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * itemsize


def init_kv_cache(config: ModelConfig, batch: int, max_len: int, dtype: jnp.dtype | str | None = None) -> KVCache:
    """An all-zero pool of `batch` blocks of `max_len` positions; dtype defaults to the compute dtype."""
    if batch <= 0 or max_len <= 0:
        raise ValueError(f"init_kv_cache: batch and max_len must be positive, got {batch}, {max_len}")
    shape = (config.num_layers, batch, max_len, config.num_kv_heads, config.head_dim)
    dtype = jnp.dtype(dtype or config.compute_dtype)
    return KVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))


def read_window(pool: jax.Array, layer: jax.Array, table: jax.Array) -> jax.Array:
    """One layer's window [B, N * block_size, K, D] of rows laid out by table[B, N]."""
    blocks = pool[layer][table]  # [B, N, block_size, K, D]
    b, n, size = blocks.shape[:3]
    return blocks.reshape(b, n * size, *blocks.shape[3:])


def store_new(
    pool: jax.Array, layer: jax.Array, table: jax.Array, window: jax.Array, positions: jax.Array
) -> jax.Array:
    """Copies the entries a step wrote into its window (at `positions`) back to the pool.

    Only those T entries per row are scattered, so the pool (a loop carry,
    updated in place) costs the step nothing beyond them. Padding (-1) goes
    past the last block and is dropped: a negative index would wrap around.
    """
    size = pool.shape[2]
    at = jnp.maximum(positions, 0)
    new = jnp.take_along_axis(window, at[:, :, None, None], axis=1)  # [B, T, K, D]
    blocks = jnp.take_along_axis(table, at // size, axis=1)
    blocks = jnp.where(positions < 0, pool.shape[1], blocks)
    return pool.at[layer, blocks, at % size].set(new.astype(pool.dtype), mode="drop")


def write_layer(cache: jax.Array, new: jax.Array, positions: jax.Array) -> jax.Array:
    """Store new[B, T, K, D] at cache[b, positions[b, t]] for one layer's cache[B, S, K, D].

    Padding positions (-1) are redirected past the end and dropped, because a
    negative index would wrap around and overwrite the last slot.
    """
    max_len = cache.shape[1]
    slots = jnp.where(positions < 0, max_len, positions)
    rows = jnp.arange(cache.shape[0])[:, None]
    return cache.at[rows, slots].set(new.astype(cache.dtype), mode="drop")
