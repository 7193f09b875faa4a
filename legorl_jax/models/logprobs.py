"""Per-token log-probabilities without materialising [B, T, V] float32 logits.

The flattened (row, position) axis is cut into chunks of `chunk_size` tokens;
each chunk's [chunk, V] logits live only inside one `lax.scan` step and are
recomputed (not stored) in the backward pass, so peak memory is
O(chunk_size * V) instead of O(B * T * V), which a 151k vocabulary makes huge.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from legorl_jax.models.transformer import CausalLM, project_logits


@jax.checkpoint
def _chunk_logprobs(hidden: jax.Array, targets: jax.Array, w: jax.Array, temperature: jax.Array) -> jax.Array:
    logits = project_logits(hidden, w) / temperature
    picked = jnp.take_along_axis(logits, targets[:, None], axis=-1)[:, 0]
    return picked - jax.nn.logsumexp(logits, axis=-1)


def token_logprobs_with_aux(
    model: CausalLM,
    tokens: jax.Array,
    *,
    positions: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    kv_end: jax.Array | None = None,
    pred_from: jax.Array | None = None,
    score_index: jax.Array | None = None,
    temperature: float = 1.0,
    chunk_size: int = 256,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """(float32[B, T-1] log p(tokens[:, 1:] | prefix) at `temperature`, aux losses).

    Logits are divided by `temperature` before the softmax, as the engine does
    when it samples at that temperature (the importance ratio needs the same
    distribution on both sides). With packed rows the
    entry at a segment boundary scores the next segment's first token and
    should be masked by the caller. Tree rows (`kv_end`, see `CausalLM.hidden`)
    give `pred_from` int32[B, T-1]: the row index whose hidden state predicts
    tokens[:, 1:] (a branch's first token is predicted by its prefix's last).

    `score_index` int32[B, S] (S < T-1) names the targets to score, per row;
    every other entry comes back 0, and entries >= T-1 pad it. The LM head then
    runs on B*S positions instead of B*(T-1): with long prompts and a large
    vocabulary it is much of the step, while the loss reads only sampled tokens.
    """
    if not temperature > 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    if tokens.ndim != 2 or tokens.shape[1] < 2:
        raise ValueError(f"tokens must be [batch, seq] with seq >= 2, got shape {tokens.shape}")
    hidden, aux = model.hidden(tokens, positions, segment_ids, kv_end)
    targets = tokens[:, 1:]
    if score_index is None:
        source = hidden[:, :-1] if pred_from is None else jnp.take_along_axis(hidden, pred_from[..., None], axis=1)
        logprobs = chunked_logprobs(
            source, targets, model.output_embedding(), temperature=temperature, chunk_size=chunk_size
        )
        return logprobs, aux
    # Padding entries read the last target (any valid one would do) and are dropped on the way back.
    index = jnp.minimum(score_index, targets.shape[1] - 1)
    rows = index if pred_from is None else jnp.take_along_axis(pred_from, index, axis=1)
    picked = chunked_logprobs(
        jnp.take_along_axis(hidden, rows[..., None], axis=1),
        jnp.take_along_axis(targets, index, axis=1),
        model.output_embedding(),
        temperature=temperature,
        chunk_size=chunk_size,
    )
    # Per-row scatter (vmapped) keeps rows independent, so a row-sharded batch needs no gather.
    zeros = jnp.zeros(targets.shape, picked.dtype)
    logprobs = jax.vmap(lambda z, i, v: z.at[i].set(v, mode="drop"))(zeros, score_index, picked)
    return logprobs, aux


def chunked_logprobs(
    hidden: jax.Array, targets: jax.Array, output_embedding: jax.Array, *, temperature: float, chunk_size: int
) -> jax.Array:
    """float32[B, T]: log softmax(hidden[b, t] @ output_embedding.T / temperature)[targets[b, t]].

    hidden [B, T, D], targets int[B, T], output_embedding [V, D].
    """
    b, t = targets.shape
    n = b * t
    chunk = min(chunk_size, n)
    padded = -(-n // chunk) * chunk
    h = jnp.pad(hidden.reshape(n, -1), ((0, padded - n), (0, 0)))
    flat_targets = jnp.pad(targets.reshape(n), (0, padded - n))
    temp = jnp.float32(temperature)

    def step(carry: None, xs: tuple[jax.Array, jax.Array]) -> tuple[None, jax.Array]:
        return carry, _chunk_logprobs(xs[0], xs[1], output_embedding, temp)

    _, out = jax.lax.scan(step, None, (h.reshape(-1, chunk, h.shape[-1]), flat_targets.reshape(-1, chunk)))
    return out.reshape(-1)[:n].reshape(b, t)


def token_logprobs(
    model: CausalLM,
    tokens: jax.Array,
    *,
    positions: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    kv_end: jax.Array | None = None,
    pred_from: jax.Array | None = None,
    score_index: jax.Array | None = None,
    temperature: float = 1.0,
    chunk_size: int = 256,
) -> jax.Array:
    """float32[B, T-1]: log p(tokens[:, 1:]); see `token_logprobs_with_aux`."""
    logprobs, _ = token_logprobs_with_aux(
        model,
        tokens,
        positions=positions,
        segment_ids=segment_ids,
        kv_end=kv_end,
        pred_from=pred_from,
        score_index=score_index,
        temperature=temperature,
        chunk_size=chunk_size,
    )
    return logprobs
