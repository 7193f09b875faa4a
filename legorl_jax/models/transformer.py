"""The causal LM: embeddings, a scanned stack of decoder layers, final norm, LM head.

Layer parameters carry a leading [num_layers] axis and one layer body runs under
`jax.lax.scan`, so compile time and program size do not grow with depth and the
remat policy applies per layer. Training (`__call__`, `hidden`) and inference
(`decode`) share `_run_layers`; they differ in the packing (segment ids, tries), in carrying a KV
cache, and (serving) in reading the projections' weights in place.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from legorl_jax.models import cpu_kernels
from legorl_jax.models.config import ModelConfig
from legorl_jax.models.kv_cache import KVCache, LayerView
from legorl_jax.models.layers import DecoderLayer, rms_norm, segment_positions
from legorl_jax.models.linear import Linear, StackedWeight
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
        self.serving = False
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

    def prepare_for_serving(self) -> None:
        """Sets the model up for the engine's steps; logits are unchanged.

        The layers stay stacked and one layer body is scanned, so a step's
        program holds one layer's code: it compiles in a fraction of the time
        and memory of the layers unrolled. The projections' stacked weights
        are not scanned over but handed whole to each layer with its index
        (`StackedWeight`): XLA on CPU copies a scanned weight's slice before a
        product reads it, which for a decode step's few rows costs more than
        the product, while the decode kernel reads layer i in place.
        """
        self.serving = True
        for _, module in nnx.iter_graph(self.layers):
            if isinstance(module, Linear):
                module.prepare_for_serving()

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
        self,
        tokens: jax.Array,
        positions: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
        kv_end: jax.Array | None = None,
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """Final-norm hidden states [B, T, D] and aux losses (`router_aux_loss` for MoE).

        Segment id 0 marks padding: it is excluded from router statistics.
        kv_end int32[B, T] makes the rows tries (`legorl_jax.rl.batching`):
        key s is seen only by queries before kv_end[s]; pass their positions.
        """
        _check_tokens(tokens, "tokens")
        if segment_ids is None:
            segment_ids = jnp.ones(tokens.shape, jnp.int32)
        if positions is None:
            positions = segment_positions(segment_ids)
        x, _, stats = self._run_layers(tokens, positions, segment_ids != 0, None, segment_ids, kv_end)
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

    def decode(
        self,
        tokens: jax.Array,
        positions: jax.Array,
        cache: KVCache,
        block_table: jax.Array | None = None,
        last: jax.Array | None = None,
    ) -> tuple[jax.Array, KVCache]:
        """Prefill or decode step over a block-pool KV cache (`kv_cache`).

        tokens, positions: int32[B, T]. block_table int32[B, N] says which pool
        blocks hold each row's positions; attention reads only those N blocks.
        Without one, row b is block b (the slot-per-row layout). Each token's
        K/V is written at its position; a query at position p attends to
        positions 0..p of its row. Position -1 marks padding: nothing is
        written and its logits are meaningless. Returns (float32[B, T, V]
        logits, new cache); with last int32[B], only each row's logits at
        index last[b] ([B, 1, V]), so a long chunk never builds [B, T, V].
        """
        _check_tokens(tokens, "tokens")
        if positions.shape != tokens.shape:
            raise ValueError(f"decode: positions shape {positions.shape} != tokens shape {tokens.shape}")
        if block_table is None:
            if cache.num_blocks != tokens.shape[0]:
                raise ValueError(f"decode: cache has {cache.num_blocks} rows, tokens have {tokens.shape[0]}")
            block_table = jnp.arange(tokens.shape[0], dtype=jnp.int32)[:, None]
        # No packing: a cache step's attention reads what each query sees from its position.
        x, new_cache, _ = self._run_layers(tokens, positions, positions >= 0, (cache, block_table), None)
        assert new_cache is not None  # a cache in is a cache out
        if last is not None:
            x = jnp.take_along_axis(x, last[:, None, None], axis=1)
        head = self.output_embedding()
        if self.serving and cpu_kernels.matmul_fits(x, head):
            return cpu_kernels.decode_matmul(x, head), new_cache  # serving's few rows; the same float32 logits
        return project_logits(x, head), new_cache

    def _run_layers(
        self,
        tokens: jax.Array,
        positions: jax.Array,
        valid: jax.Array,
        cache: tuple[KVCache, jax.Array] | None,
        segment_ids: jax.Array | None,
        kv_end: jax.Array | None = None,
    ) -> tuple[jax.Array, KVCache | None, RouterStats | None]:
        rope = rope_tables(self.config, positions)
        pools = None if cache is None else (cache[0].k, cache[0].v)

        def body(carry: tuple[jax.Array, Any], layer: DecoderLayer, index: jax.Array) -> tuple[Any, Any]:
            x, pools = carry
            if cache is None:
                x, _, stats = layer(x, rope, None, positions, valid, segment_ids, kv_end)
                return (x, pools), stats
            # The pools ride in the carry, so each layer updates them in place:
            # a step writes only its new entries and gathers its window's blocks once.
            view = LayerView(k=pools[0], v=pools[1], layer=index, table=cache[1])
            x, written, stats = layer(x, rope, view, positions, valid, segment_ids)
            assert written is not None  # a layer given the pool returns it updated
            return (x, (written.k, written.v)), stats

        x = self.embed_tokens(tokens)
        # Serving holds the projections' weights whole (see `prepare_for_serving`);
        # everything else is scanned over, one layer's slice per step.
        whole = {(*path, "weight") for path, node in nnx.iter_graph(self.layers) if isinstance(node, Linear)}
        graphdef, *states = nnx.split(self.layers, lambda path, _: self.serving and path in whole, ...)
        held, params = states

        def scanned(carry: tuple[jax.Array, Any], xs: tuple[Any, jax.Array]) -> tuple[Any, Any]:
            views = jax.tree.map(lambda stack: StackedWeight(stack, xs[1]), held)
            return body(carry, nnx.merge(graphdef, views, xs[0]), xs[1])

        if self.config.remat != "none" and not self.serving:
            scanned = jax.checkpoint(scanned, policy=_REMAT_POLICIES[self.config.remat], prevent_cse=False)
        layer_index = jnp.arange(self.config.num_layers)
        (x, pools), stats = jax.lax.scan(scanned, (x, pools), (params, layer_index))
        new_cache = None if pools is None else KVCache(k=pools[0], v=pools[1])
        return self.norm(x), new_cache, stats


def project_logits(hidden: jax.Array, output_embedding: jax.Array) -> jax.Array:
    """float32 logits; matmul in the compute dtype with float32 accumulation."""
    return jnp.einsum(
        "...d,vd->...v", hidden.astype(output_embedding.dtype), output_embedding, preferred_element_type=jnp.float32
    )


def _check_tokens(tokens: jax.Array, name: str) -> None:
    if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise ValueError(f"{name} must be an integer array [batch, seq], got {tokens.dtype}{list(tokens.shape)}")
