"""KV cache for the inference engine: a pool of fixed-size blocks.

k, v are [layers, kv_heads, blocks, block_size, head_dim]. A step gives each
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
    """k, v: [layers, kv_heads, blocks, block_size, head_dim]; heads before blocks, so
    the blocks a step reads come out head-major, as attention's products take them."""

    k: jax.Array
    v: jax.Array

    @property
    def block_size(self) -> int:
        return self.k.shape[3]

    @property
    def num_blocks(self) -> int:
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
    shape = (config.num_layers, config.num_kv_heads, batch, max_len, config.head_dim)
    dtype = jnp.dtype(dtype or config.compute_dtype)
    return KVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))


@struct.dataclass
class LayerView:
    """What one layer's attention needs of the pool in a KV-cache step: the
    whole pool (k, v), which layer it is, and the rows' block tables int32[B, N].

    The layer writes its new entries into the pool and reads its keys from
    there a tile of blocks at a time, so no step ever copies a row's whole
    window out of the pool.
    """

    k: jax.Array
    v: jax.Array
    layer: jax.Array
    table: jax.Array


def store_new(pool: jax.Array, layer: jax.Array, table: jax.Array, new: jax.Array, positions: jax.Array) -> jax.Array:
    """Writes new[B, T, K, D] into one layer of the pool at `positions` int32[B, T].

    Only those T entries per row are scattered, so the pool (a loop carry,
    updated in place) costs the step nothing beyond them. Padding (-1) goes
    past the last block and is dropped: a negative index would wrap around.
    """
    size = pool.shape[3]
    at = jnp.maximum(positions, 0)
    blocks = jnp.take_along_axis(table, at // size, axis=1)
    blocks = jnp.where(positions < 0, pool.shape[2], blocks)
    # Indices split by the head slice put their [B, T] dims first: the value is [B, T, K, D].
    return pool.at[layer, :, blocks, at % size].set(new.astype(pool.dtype), mode="drop")


def read_blocks(pool: jax.Array, layer: jax.Array, table: jax.Array) -> jax.Array:
    """Keys (or values) of the blocks table[B, n] of one layer: [K, B, n * block_size, D].

    Heads lead, so attention's products batch over (head, row) with no transpose.
    The layer is read as one list of (head, block) entries: indexing its block
    axis instead makes XLA gather block-major and then transpose the whole
    window into head-major order, a second copy of it every layer.
    """
    _, k, blocks, size, d = pool.shape
    b, n = table.shape
    entries = (jnp.arange(k, dtype=table.dtype)[:, None, None] * blocks + table[None]).reshape(-1)
    return pool[layer].reshape(k * blocks, size, d)[entries].reshape(k, b, n * size, d)
