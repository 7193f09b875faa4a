"""Rotary position embedding in the HF "rotate half" layout.

HF checkpoints store q/k projections for the half-split rotation (first half of
each head pairs with the second half), not the interleaved one; using the other
layout still runs and silently degrades the model (maxtext #1774).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from legorl_jax.models.config import ModelConfig


def inverse_frequencies(config: ModelConfig) -> np.ndarray:
    """float32[head_dim // 2], with Llama 3 frequency-dependent scaling applied."""
    dim = config.head_dim
    # float32 like transformers, so positions far out rotate identically.
    exponents = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    inv_freq = (1.0 / (np.float32(config.rope_theta) ** exponents)).astype(np.float32)
    s = config.rope_scaling
    if s is None:
        return inv_freq
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def rope_tables(config: ModelConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos, sin: float32[B, T, head_dim] for int positions[B, T]."""
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inverse_frequencies(config))
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate x[B, T, heads, head_dim] by per-token angles cos/sin[B, T, head_dim]."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    cos, sin = cos[:, :, None, :].astype(x.dtype), sin[:, :, None, :].astype(x.dtype)
    return x * cos + rotated * sin
