"""Sampling on device: temperature, top-k, top-p, seeded per row, and the
processed logprobs vLLM reports in `--logprobs-mode processed_logprobs`.

Everything here is a pure function of arrays, shaped [S, V] for S engine slots,
so one compiled program serves any mix of per-request sampling parameters.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# A temperature at or below this samples greedily (vLLM's convention). The
# logprobs of a greedy row are then those of the untempered distribution.
GREEDY_EPS = 1e-5


def effective_temperature(temperature: jax.Array) -> jax.Array:
    return jnp.where(temperature <= GREEDY_EPS, 1.0, temperature)


def _filter_top_k_top_p(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Masks (to -inf) what top-k and then top-p exclude; row-wise on [S, V]."""
    vocab = scaled.shape[-1]
    ordered = jnp.sort(scaled, axis=-1)[:, ::-1]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    ranks = jnp.arange(vocab)[None, :]
    ordered = jnp.where(ranks < k[:, None], ordered, -jnp.inf)
    probs = jax.nn.softmax(ordered, axis=-1)
    # Keep a token while the mass strictly before it is below top_p: the
    # smallest set whose mass reaches top_p, never empty.
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    kept = (mass_before < top_p[:, None]) & (ranks < k[:, None])
    n_kept = jnp.maximum(jnp.sum(kept, axis=-1), 1)
    # Ties with the last kept logit stay in: the mask is a threshold on values.
    threshold = jnp.take_along_axis(ordered, (n_kept - 1)[:, None], axis=-1)
    return jnp.where(scaled >= threshold, scaled, -jnp.inf)


def processed_logprobs(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """log-softmax of logits / T after top-k/top-p masking: f32[S, V].

    The full-vocabulary sort only runs when some row filters, so RL sampling
    (top_p = 1, top_k = -1) never pays for it.
    """
    scaled = logits.astype(jnp.float32) / effective_temperature(temperature)[:, None]
    filtering = jnp.any((top_k > 0) | (top_p < 1.0))
    filtered = jax.lax.cond(filtering, lambda s: _filter_top_k_top_p(s, top_k, top_p), lambda s: s, scaled)
    return jax.nn.log_softmax(filtered, axis=-1)


def row_keys(seeds: jax.Array, counters: jax.Array) -> jax.Array:
    """One PRNG key per row from (request seed, index of the token in the request):
    a request's samples depend on its seed only, never on which rows it shares a batch with."""
    return jax.vmap(lambda s, c: jax.random.fold_in(jax.random.key(s), c))(seeds, counters)


def first_argmax(x: jax.Array) -> jax.Array:
    """jnp.argmax over the last axis (first maximum; first NaN if any), as a max
    then a min: two plain reductions, which XLA on CPU runs several times faster
    than argmax's paired value-index reduction over a vocabulary."""
    top = jnp.max(x, axis=-1, keepdims=True)
    hit = (x == top) | jnp.isnan(x)
    return jnp.min(jnp.where(hit, jnp.arange(x.shape[-1], dtype=jnp.int32), x.shape[-1]), axis=-1)


def _gumbel_argmax(logprobs: jax.Array, seeds: jax.Array, counters: jax.Array) -> jax.Array:
    """argmax of logprobs + per-row seeded Gumbel noise: an exact draw from softmax(logprobs)."""
    keys = row_keys(seeds, counters)
    gumbel = jax.vmap(lambda k: jax.random.gumbel(k, logprobs.shape[-1:], jnp.float32))(keys)
    # The barrier keeps the noise from being recomputed inside both passes of the argmax.
    return first_argmax(jax.lax.optimization_barrier(logprobs + gumbel))


def sample(
    logits: jax.Array,
    temperature: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
    seeds: jax.Array,
    counters: jax.Array,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Samples one token per row. Returns (token i32[S], its processed logprob
    f32[S], the processed logprobs f32[S, V] for top-k reporting)."""
    logprobs = processed_logprobs(logits, temperature, top_k, top_p)
    greedy_rows = temperature <= GREEDY_EPS
    greedy = first_argmax(logprobs)
    # Noise over the whole vocabulary costs more than the rest of sampling, so
    # a batch of greedy rows draws none. A row's noise depends only on its seed
    # and counter, so skipping it for a batch changes no sampled row's token.
    token = jax.lax.cond(
        jnp.all(greedy_rows),
        lambda: greedy,
        lambda: jnp.where(greedy_rows, greedy, _gumbel_argmax(logprobs, seeds, counters)),
    ).astype(jnp.int32)
    chosen = jnp.take_along_axis(logprobs, token[:, None], axis=-1)[:, 0]
    return token, chosen, logprobs


def target_logprobs(
    logits: jax.Array, targets: jax.Array, temperature: jax.Array, top: int
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Prompt logprobs at the request's temperature. logits f32[S, C, V],
    targets i32[S, C] (the next prompt token; negative where there is none) ->
    (its logprob f32[S, C], its 1-based rank i32[S, C], the `top` best
    logprobs f32[S, C, top] and their ids i32[S, C, top])."""
    scaled = logits.astype(jnp.float32) / effective_temperature(temperature)[:, None, None]
    logprobs = jax.nn.log_softmax(scaled, axis=-1)
    safe = jnp.maximum(targets, 0)
    chosen = jnp.take_along_axis(logprobs, safe[..., None], axis=-1)[..., 0]
    rank = 1 + jnp.sum(logprobs > chosen[..., None], axis=-1).astype(jnp.int32)
    top_values, top_ids = jax.lax.top_k(logprobs, top)
    return chosen, rank, top_values, top_ids
