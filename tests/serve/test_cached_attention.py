"""The engine's paged, tiled attention over pool blocks equals masked full attention."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from legorl_jax.models import attention
from legorl_jax.models.attention import paged_attention
from legorl_jax.models.kv_cache import LayerView


def _reference(q: np.ndarray, k: np.ndarray, v: np.ndarray, positions: np.ndarray) -> jax.Array:
    seen = np.maximum(positions, 0)
    mask = (np.arange(k.shape[1])[None, None, :] <= seen[:, :, None])[:, None]
    return jax.nn.dot_product_attention(q, k, v, mask=jnp.asarray(mask), implementation="xla")


def _paged(window: np.ndarray, table: np.ndarray, blocks: int, block: int, layers: int = 2) -> np.ndarray:
    """A pool [layers, K, blocks, block, D] whose layer 1 holds each row's window[b] in the blocks table[b]."""
    rows, _, kv_heads, dim = window.shape
    pool = np.random.default_rng(9).standard_normal((layers, kv_heads, blocks, block, dim), np.float32)
    for b in range(rows):
        for n, block_id in enumerate(table[b]):
            part = window[b, n * block : (n + 1) * block]
            pool[1, :, block_id, : len(part)] = part.transpose(1, 0, 2)
    return pool


@pytest.mark.parametrize(("tile", "pairs"), [(4, 0), (8, 0), (64, 0), (4, attention.TILE_PAIRS)])
def test_tiles_give_the_full_softmax(tile: int, pairs: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # pairs 0 keeps tiles at `tile` keys; the default widens this small step's tile to the whole window.
    monkeypatch.setattr(attention, "TILE_PAIRS", pairs)
    rng = np.random.default_rng(0)
    block, width, heads, kv_heads, dim = 4, 6, 6, 2, 8  # a window of 24 positions in 6 blocks of 4
    window = 22  # positions past 21 are never read: the last block is partly stale
    q = rng.standard_normal((3, 5, heads, dim), np.float32)
    k, v = (rng.standard_normal((3, width * block, kv_heads, dim), np.float32) for _ in range(2))
    # Rows own scattered blocks of a shared pool (block 0 is nobody's).
    table = rng.permutation(np.arange(1, 1 + 3 * width)).reshape(3, width).astype(np.int32)
    pool_k, pool_v = (_paged(x, table, 1 + 3 * width, block) for x in (k, v))
    # Row 0 ends the window, row 1 sits in its first tile, row 2 is a decode row plus padding.
    positions = np.array([[17, 18, 19, 20, 21], [0, 1, 2, 3, 4], [9, -1, -1, -1, -1]], np.int32)
    view = LayerView(k=jnp.asarray(pool_k), v=jnp.asarray(pool_v), layer=jnp.int32(1), table=jnp.asarray(table))
    got = jax.jit(paged_attention, static_argnums=3)(jnp.asarray(q), view, jnp.asarray(positions), tile)
    want = _reference(q, k[:, :window], v[:, :window], positions)
    np.testing.assert_allclose(got, want, atol=2e-6, rtol=0)


def test_keys_past_the_furthest_query_are_never_read(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(attention, "TILE_PAIRS", 0)  # tiles of 4 keys, as a long prefill's
    rng = np.random.default_rng(1)
    q = rng.standard_normal((1, 2, 2, 4), np.float32)
    k, v = (rng.standard_normal((1, 16, 1, 4), np.float32) for _ in range(2))
    positions = np.array([[2, 3]], np.int32)
    # NaN keys beyond position 3 would poison any tile that read them, masked or not.
    k[:, 4:], v[:, 4:] = np.nan, np.nan
    table = np.array([[1, 2, 3, 4]], np.int32)
    pool_k, pool_v = (_paged(x, table, 5, 4) for x in (k, v))
    view = LayerView(k=jnp.asarray(pool_k), v=jnp.asarray(pool_v), layer=jnp.int32(1), table=jnp.asarray(table))
    got = paged_attention(jnp.asarray(q), view, jnp.asarray(positions), tile=4)
    assert np.isfinite(np.asarray(got)).all()
    np.testing.assert_allclose(got, _reference(q, k[:, :4], v[:, :4], positions), atol=2e-6, rtol=0)
