"""Blockwise attention for training rows: memory linear in the row length.

softmax(q k^T / sqrt(H)) v over packed rows (segment ids) and tries (`kv_end`),
computed one [block x block] tile at a time with a running max and sum (the
FlashAttention scheme) in plain XLA, so it runs on any backend. The forward
pass keeps only the output and each query's log-sum-exp; the backward pass
(a custom VJP) recomputes each tile's probabilities from them. Neither pass
holds a [T, T] score matrix: XLA's dense scores for one 26k-token row of a
12-head model are 32 GB in float32, these tiles a few MB.

Only tiles some query of the block can see are computed, in both passes:
tiles above the causal diagonal are skipped, and so are tiles whose keys
belong to other segments and (tree rows) tiles whose keys' subtrees end
before the query block starts, i.e. another member's continuation. The
loops run over per-block lists of live tiles, so skipped tiles cost nothing.

Every query must see at least one key (itself, in the layouts the packer
builds); a query that sees none gets 0, not NaN.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

_F32 = jnp.float32


def blockwise_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, kv_end: jax.Array | None, *, block: int
) -> jax.Array:
    """q[B, T, N, H], k/v[B, T, K, H], segment_ids int32[B, T] -> [B, T, N, H].

    A query at index t sees key s when s <= t, both share a segment id and
    (given kv_end int32[B, T]) t < kv_end[s]. Query head i reads kv head
    i // (N / K), as `jax.nn.dot_product_attention` groups them. `block`
    must divide T.
    """
    b, t, n, h = q.shape
    kv = k.shape[2]
    if t % block:
        raise ValueError(f"blockwise attention needs a row length that is a multiple of {block}, got {t}")
    if kv_end is None:
        kv_end = jnp.full((b, t), t, jnp.int32)
    grouped = q.reshape(b, t, kv, n // kv, h).transpose(0, 2, 3, 1, 4)  # [B, K, G, T, H]
    heads_major = partial(jnp.swapaxes, axis1=1, axis2=2)  # [B, T, K, H] -> [B, K, T, H]
    out = _attention(grouped, heads_major(k), heads_major(v), segment_ids, kv_end, block)
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, n, h)


def _live_tiles(segment_ids: jax.Array, kv_end: jax.Array, block: int) -> jax.Array:
    """bool[nb, nb]: whether tile (query block i, key block j) holds a visible pair in any row."""
    b, t = segment_ids.shape
    nb = t // block
    seg = segment_ids.reshape(b, nb, block)
    lo, hi = seg.min(-1), seg.max(-1)
    # Segment ranges that do not overlap share no id (ids need not be sorted for this to hold).
    shared = (lo[:, :, None] <= hi[:, None, :]) & (lo[:, None, :] <= hi[:, :, None])
    reach = kv_end.reshape(b, nb, block).max(-1)  # the furthest query any key of block j is seen by
    starts = jnp.arange(nb, dtype=jnp.int32) * block
    seen = reach[:, None, :] > starts[None, :, None]
    causal = jnp.tril(jnp.ones((nb, nb), bool))
    return causal & jnp.any(shared & seen, axis=0)


def _listed(live: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per row of live[nb, nb]: the live column indices first (in order), and how many there are."""
    order = jnp.argsort(~live, axis=1, stable=True).astype(jnp.int32)
    return order, live.sum(1).astype(jnp.int32)


def _tile_mask(segment_ids: jax.Array, kv_end: jax.Array, i: jax.Array, j: jax.Array, block: int) -> jax.Array:
    """bool[B, 1, 1, block, block]: which (query of block i, key of block j) pairs are visible."""
    qi = i * block + jnp.arange(block, dtype=jnp.int32)
    kj = j * block + jnp.arange(block, dtype=jnp.int32)
    q_seg = jax.lax.dynamic_slice_in_dim(segment_ids, i * block, block, axis=1)
    k_seg = jax.lax.dynamic_slice_in_dim(segment_ids, j * block, block, axis=1)
    k_end = jax.lax.dynamic_slice_in_dim(kv_end, j * block, block, axis=1)
    mask = (kj[None, None, :] <= qi[None, :, None]) & (q_seg[:, :, None] == k_seg[:, None, :])
    mask &= qi[None, :, None] < k_end[:, None, :]
    return mask[:, None, None]


def _scores(qi: jax.Array, kj: jax.Array, mask: jax.Array) -> jax.Array:
    """float32[B, K, G, block, block] scaled scores, -inf where not visible."""
    s = jnp.einsum("bkgqh,bksh->bkgqs", qi, kj, preferred_element_type=_F32) * qi.shape[-1] ** -0.5
    return jnp.where(mask, s, -jnp.inf)


def _block(x: jax.Array, i: jax.Array, block: int, axis: int) -> jax.Array:
    return jax.lax.dynamic_slice_in_dim(x, i * block, block, axis=axis)


def _put(x: jax.Array, part: jax.Array, i: jax.Array, block: int, axis: int) -> jax.Array:
    return jax.lax.dynamic_update_slice_in_dim(x, part.astype(x.dtype), i * block, axis=axis)


def _forward(
    q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, kv_end: jax.Array, block: int
) -> tuple[jax.Array, jax.Array]:
    """Output [B, K, G, T, H] and each query's log-sum-exp float32[B, K, G, T]."""
    nb = q.shape[3] // block
    cols, counts = _listed(_live_tiles(segment_ids, kv_end, block))

    def query_block(i: jax.Array, outs: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        qi = _block(q, i, block, axis=3)

        def tile(n: jax.Array, carry: tuple[jax.Array, jax.Array, jax.Array]) -> tuple[jax.Array, ...]:
            top, total, acc = carry
            j = cols[i, n]
            s = _scores(qi, _block(k, j, block, axis=2), _tile_mask(segment_ids, kv_end, i, j, block))
            new_top = jnp.maximum(top, s.max(-1))
            # A query that has seen nothing yet keeps max -inf; shift by 0 then, so no -inf - -inf.
            shift = jnp.where(jnp.isfinite(new_top), new_top, 0.0)
            probs = jnp.exp(s - shift[..., None])
            rescale = jnp.exp(top - shift)
            vj = _block(v, j, block, axis=2)
            update = jnp.einsum("bkgqs,bksh->bkgqh", probs.astype(v.dtype), vj, preferred_element_type=_F32)
            return new_top, total * rescale + probs.sum(-1), acc * rescale[..., None] + update

        stats = qi.shape[:-1]
        init = (jnp.full(stats, -jnp.inf, _F32), jnp.zeros(stats, _F32), jnp.zeros(qi.shape, _F32))
        top, total, acc = jax.lax.fori_loop(0, counts[i], tile, init)
        seen = total > 0
        out_i = jnp.where(seen[..., None], acc / jnp.where(seen, total, 1.0)[..., None], 0.0)
        # +inf for a query that saw nothing makes the backward pass's probabilities 0 there.
        lse_i = jnp.where(seen, top + jnp.log(jnp.where(seen, total, 1.0)), jnp.inf)
        out, lse = outs
        return _put(out, out_i, i, block, axis=3), _put(lse, lse_i, i, block, axis=3)

    init = (jnp.zeros(q.shape, q.dtype), jnp.zeros(q.shape[:-1], _F32))
    return jax.lax.fori_loop(0, nb, query_block, init)


@partial(jax.custom_vjp, nondiff_argnums=(5,))
def _attention(
    q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, kv_end: jax.Array, block: int
) -> jax.Array:
    return _forward(q, k, v, segment_ids, kv_end, block)[0]


def _attention_fwd(
    q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, kv_end: jax.Array, block: int
) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    out, lse = _forward(q, k, v, segment_ids, kv_end, block)
    return out, (q, k, v, segment_ids, kv_end, out, lse)


def _attention_bwd(block: int, residuals: tuple[jax.Array, ...], d_out: jax.Array) -> tuple[jax.Array | None, ...]:
    """Gradients w.r.t. q, k, v: for each key block, over the query blocks that see it
    (dK and dV accumulate in the loop; dQ is added into its block of a whole-row array)."""
    q, k, v, segment_ids, kv_end, out, lse = residuals
    nb = q.shape[3] // block
    # softmax' term: D = rowsum(dO * O).
    d = jnp.sum(d_out.astype(_F32) * out.astype(_F32), axis=-1)
    rows, counts = _listed(_live_tiles(segment_ids, kv_end, block).T)
    scale = q.shape[-1] ** -0.5

    def key_block(j: jax.Array, grads: tuple[jax.Array, jax.Array, jax.Array]) -> tuple[jax.Array, ...]:
        kj, vj = _block(k, j, block, axis=2), _block(v, j, block, axis=2)

        def tile(n: jax.Array, carry: tuple[jax.Array, jax.Array, jax.Array]) -> tuple[jax.Array, ...]:
            dq, dk_j, dv_j = carry
            i = rows[j, n]
            qi, do_i = _block(q, i, block, axis=3), _block(d_out, i, block, axis=3)
            s = _scores(qi, kj, _tile_mask(segment_ids, kv_end, i, j, block))
            probs = jnp.exp(s - _block(lse, i, block, axis=3)[..., None])
            dv_j += jnp.einsum("bkgqs,bkgqh->bksh", probs.astype(v.dtype), do_i, preferred_element_type=_F32)
            dp = jnp.einsum("bkgqh,bksh->bkgqs", do_i, vj, preferred_element_type=_F32)
            ds = (probs * (dp - _block(d, i, block, axis=3)[..., None]) * scale).astype(q.dtype)
            dk_j += jnp.einsum("bkgqs,bkgqh->bksh", ds, qi, preferred_element_type=_F32)
            dq_i = jnp.einsum("bkgqs,bksh->bkgqh", ds, kj, preferred_element_type=_F32)
            return _put(dq, _block(dq, i, block, axis=3) + dq_i, i, block, axis=3), dk_j, dv_j

        dq, dk, dv = grads
        init = (dq, jnp.zeros(kj.shape, _F32), jnp.zeros(vj.shape, _F32))
        dq, dk_j, dv_j = jax.lax.fori_loop(0, counts[j], tile, init)
        return dq, _put(dk, dk_j, j, block, axis=2), _put(dv, dv_j, j, block, axis=2)

    init = (jnp.zeros(q.shape, _F32), jnp.zeros(k.shape, _F32), jnp.zeros(v.shape, _F32))
    dq, dk, dv = jax.lax.fori_loop(0, nb, key_block, init)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None


_attention.defvjp(_attention_fwd, _attention_bwd)
