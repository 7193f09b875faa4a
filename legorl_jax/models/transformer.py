"""The causal LM: embeddings, a scanned stack of decoder layers, final norm, LM head.

Layer parameters carry a leading [num_layers] axis and one layer body runs under
`jax.lax.scan`, so compile time does not grow with depth and the remat policy
applies per layer. Training (`__call__`, `hidden`) and inference (`decode`)
share `_run_layers`; they differ only in the mask and in carrying a KV cache.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from legorl_jax.models.config import ModelConfig
from legorl_jax.models.kv_cache import KVCache, cache_mask
from legorl_jax.models.layers import DecoderLayer, causal_segment_mask, rms_norm, segment_positions
from legorl_jax.models.moe import RouterStats, load_balancing_loss
from legorl_jax.models.rope import rope_tables

_REMAT_POLICIES: dict[str, Any] = {
    "full": None,  # save nothing: recompute the whole layer in the backward pass
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
}


def _stacked_layers(config: ModelConfig, rngs: nnx.Rngs) -> DecoderLayer:
    @nnx.split_rngs(splits=config.num_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs: nnx.Rngs) -> DecoderLayer:
        return DecoderLayer(config, rngs=rngs)

    return make(rngs)


class CausalLM(nnx.Module):
    """Qwen3 / Qwen3-MoE / Qwen2 / Llama 3 decoder-only LM. See `legorl_jax.models`."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs) -> None:
        self.config = config
        self.embed_tokens = nnx.Embed(
            config.vocab_size,
            config.hidden_size,
            dtype=config.compute_dtype,
            param_dtype=config.param_dtype,
            rngs=rngs,
        )
        self.layers = _stacked_layers(config, rngs)
        self.norm = rms_norm(config, rngs, config.hidden_size)
        # Stored [V, D] like HF's lm_head.weight (and like a tied embedding), so
        # chunked logits never need a transposed copy of the biggest matrix.
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else nnx.Embed(
                config.vocab_size,
                config.hidden_size,
                dtype=config.compute_dtype,
                param_dtype=config.param_dtype,
                rngs=rngs,
            )
        )

    def __call__(
        self, tokens: jax.Array, positions: jax.Array | None = None, segment_ids: jax.Array | None = None
    ) -> jax.Array:
        """float32[B, T, V] logits for int32[B, T] tokens.

        segment_ids[B, T] (optional) packs several sequences in a row: a token
        attends only to earlier tokens of the same segment id. Positions default
        to each token's index within its segment.
        """
        hidden, _ = self.hidden(tokens, positions, segment_ids)
        return self.logits(hidden)

    def hidden(
        self, tokens: jax.Array, positions: jax.Array | None = None, segment_ids: jax.Array | None = None
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """Final-norm hidden states [B, T, D] and aux losses (`router_aux_loss` for MoE).

        Segment id 0 marks padding: it is excluded from router statistics.
        """
        _check_tokens(tokens, "tokens")
        if segment_ids is None:
            segment_ids = jnp.ones(tokens.shape, jnp.int32)
        if positions is None:
            positions = segment_positions(segment_ids)
        mask = causal_segment_mask(segment_ids)
        x, _, stats = self._run_layers(tokens, positions, mask, segment_ids != 0, cache=None, segment_ids=segment_ids)
        aux: dict[str, jax.Array] = {}
        if stats is not None:
            aux["router_aux_loss"] = load_balancing_loss(stats, self.config.num_experts)
        return x, aux

    def logits(self, hidden: jax.Array) -> jax.Array:
        """float32 logits for hidden states [..., D] from `hidden`."""
        return project_logits(hidden, self.output_embedding())

    def output_embedding(self) -> jax.Array:
        """[V, D] LM-head matrix in compute dtype (the input embedding when tied)."""
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        return head.embedding[...].astype(self.config.compute_dtype)

    def decode(self, tokens: jax.Array, positions: jax.Array, cache: KVCache) -> tuple[jax.Array, KVCache]:
        """Prefill or decode step over a slot-per-row KV cache.

        tokens, positions: int32[B, T]. Each token's K/V is written at index
        `position` of its row; a query at position p attends to slots 0..p of
        its own row. Position -1 marks padding: nothing is written and its
        logits are meaningless. Returns (float32[B, T, V] logits, new cache).
        """
        _check_tokens(tokens, "tokens")
        if positions.shape != tokens.shape:
            raise ValueError(f"decode: positions shape {positions.shape} != tokens shape {tokens.shape}")
        if cache.k.shape[1] != tokens.shape[0]:
            raise ValueError(f"decode: cache has {cache.k.shape[1]} rows, tokens have {tokens.shape[0]}")
        mask = cache_mask(positions, cache.max_len)
        x, cache, _ = self._run_layers(tokens, positions, mask, positions >= 0, cache, segment_ids=None)
        return self.logits(x), cache

    def _run_layers(
        self,
        tokens: jax.Array,
        positions: jax.Array,
        mask: jax.Array,
        valid: jax.Array,
        cache: KVCache | None,
        segment_ids: jax.Array | None,
    ) -> tuple[jax.Array, KVCache | None, RouterStats | None]:
        rope = rope_tables(self.config, positions)
        graphdef, params = nnx.split(self.layers)

        def body(x: jax.Array, xs: tuple[Any, Any]) -> tuple[jax.Array, tuple[Any, Any]]:
            layer_params, layer_cache = xs
            layer = nnx.merge(graphdef, layer_params)
            x, layer_cache, stats = layer(x, rope, mask, layer_cache, positions, valid, segment_ids)
            return x, (layer_cache, stats)

        if self.config.remat != "none":
            body = jax.checkpoint(body, policy=_REMAT_POLICIES[self.config.remat], prevent_cse=False)
        layer_caches = None if cache is None else (cache.k, cache.v)
        x = self.embed_tokens(tokens)
        x, (layer_caches, stats) = jax.lax.scan(body, x, (params, layer_caches))
        new_cache = None if layer_caches is None else KVCache(k=layer_caches[0], v=layer_caches[1])
        return self.norm(x), new_cache, stats


def project_logits(hidden: jax.Array, output_embedding: jax.Array) -> jax.Array:
    """float32 logits; matmul in the compute dtype with float32 accumulation."""
    return jnp.einsum(
        "...d,vd->...v", hidden.astype(output_embedding.dtype), output_embedding, preferred_element_type=jnp.float32
    )


def _check_tokens(tokens: jax.Array, name: str) -> None:
    if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise ValueError(f"{name} must be an integer array [batch, seq], got {tokens.dtype}{list(tokens.shape)}")
