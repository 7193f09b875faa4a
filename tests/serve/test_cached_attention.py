"""The engine's tiled attention over a KV window equals masked full attention."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from legorl_jax.models.attention import cached_attention


def _reference(q: np.ndarray, k: np.ndarray, v: np.ndarray, positions: np.ndarray) -> jax.Array:
    seen = np.maximum(positions, 0)
    mask = (np.arange(k.shape[1])[None, None, :] <= seen[:, :, None])[:, None]
    return jax.nn.dot_product_attention(q, k, v, mask=jnp.asarray(mask), implementation="xla")


@pytest.mark.parametrize("tile", [4, 8, 64])
def test_tiles_give_the_full_softmax(tile: int) -> None:
    rng = np.random.default_rng(0)
    window, heads, kv_heads, dim = 22, 6, 2, 8  # 22 is no multiple of 4 or 8: the last tile is padded
    q = rng.standard_normal((3, 5, heads, dim), np.float32)
    k, v = (rng.standard_normal((3, window, kv_heads, dim), np.float32) for _ in range(2))
    # Row 0 ends the window, row 1 sits in its first tile, row 2 is a decode row plus padding.
    positions = np.array([[17, 18, 19, 20, 21], [0, 1, 2, 3, 4], [9, -1, -1, -1, -1]], np.int32)
    got = jax.jit(cached_attention, static_argnums=4)(q, k, v, positions, tile)
    np.testing.assert_allclose(got, _reference(q, k, v, positions), atol=2e-6, rtol=0)


def test_keys_past_the_furthest_query_are_never_read() -> None:
    rng = np.random.default_rng(1)
    q = rng.standard_normal((1, 2, 2, 4), np.float32)
    k, v = (rng.standard_normal((1, 16, 1, 4), np.float32) for _ in range(2))
    positions = np.array([[2, 3]], np.int32)
    # NaN keys beyond position 3 would poison any tile that read them, masked or not.
    k[:, 4:], v[:, 4:] = np.nan, np.nan
    got = cached_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(positions), tile=4)
    assert np.isfinite(np.asarray(got)).all()
    np.testing.assert_allclose(got, _reference(q, k[:, :4], v[:, :4], positions), atol=2e-6, rtol=0)
