"""The policy network: Flax NNX Qwen3 family with exact HF import/export.

Public API (import from `legorl_jax.models`):

- `from_hf(path, *, dtype="float32", compute_dtype=None, remat="none", attention_kernel="auto", mesh=None) -> CausalLM`
  loads an HF checkpoint directory (Qwen3, Qwen3-MoE, Qwen2/2.5, Llama 3).
  `attention_kernel`: "auto" (cuDNN's fused kernel on NVIDIA GPUs with 16-bit
  compute; Pallas splash attention on TPU; blockwise elsewhere for rows of two or
  more 128-multiple tiles), "xla", "cudnn", "splash" or "blockwise" (`models/attention.py`).
- `to_hf(model, out_dir, *, tokenizer_from=None, dtype=None, max_shard_bytes=5 GiB) -> Path`
  writes config.json, generation_config.json, model*.safetensors (+ index when
  sharded) and copies tokenizer files.
- `CausalLM(config, rngs=nnx.Rngs(seed))`: a randomly initialised model.
  - `model(tokens, positions=None, segment_ids=None) -> float32[B, T, V]` logits;
    segment ids pack several sequences per row (no cross-segment attention),
    positions default to the index within each segment.
  - `model.hidden(tokens, positions=None, segment_ids=None) -> (hidden[B, T, D], aux)`;
    aux has "router_aux_loss" for MoE (unscaled; scale by
    `config.router_aux_loss_coef`). `model.logits(hidden) -> float32`.
  - `model.decode(tokens, positions, cache, block_table=None, last=None) -> (float32[B, T, V] logits, KVCache)`:
    prefill (T = chunk) and decode (T = 1) over a pool of KV blocks. Row b's
    positions live in blocks block_table[b] (int32[B, N]; attention reads only
    those N blocks); without a table row b is block b (slot per row). Each
    token's K/V goes to its position; a query at position p attends to
    positions 0..p of its row; position -1 is padding (not written, logits
    meaningless). `last` int32[B] returns only those positions' logits
    ([B, 1, V]). Static shapes: jit it once per (B, T, N).
  - `model.config: ModelConfig`.
- `init_kv_cache(config, blocks, block_size, dtype=None) -> KVCache` (k, v:
  [layers, kv_heads, blocks, block_size, head_dim]); `kv_cache.kv_bytes_per_token`;
  `model.prepare_for_serving()` (the engine's steps: projections read in place from
  the layer stack, decode products on the CPU kernels).
- `token_logprobs(model, tokens, *, positions=None, segment_ids=None,
  temperature=1.0, chunk_size=256) -> float32[B, T-1]`: log p(tokens[:, 1:]),
  computed over chunks of `chunk_size` tokens so [B, T, V] float32 logits
  never exist (also in the backward pass); `token_logprobs_with_aux` also
  returns the aux dict; `score_index` int32[B, S] limits the head to those
  targets (0 elsewhere); `logprobs.chunked_logprobs(hidden, targets, w, ...)`
  is the same head on given hidden states.
- Orbax: `orbax_io.save_params(model, dir)` / `orbax_io.load_params(dir, config, step=None, mesh=None)`
  (the `params` item of the learner's checkpoint layout); CLI `legorl convert`.
- `ModelConfig`, `from_hf_config(dict, **runtime)`, `to_hf_config(config, dtype=...)`,
  `UnsupportedConfigError` (names the offending HF field).
- Sharding: `make_mesh(data=1, fsdp=-1, tensor=1, expert=1)`,
  `partition_spec(path, shape, mesh)`, `batch_sharding(mesh)`.

Parameter layout: every tensor keeps HF's layout (linear weights [out, in],
embeddings and lm_head [V, D]); per-layer tensors are stacked on a leading
[num_layers] axis (MoE experts: [num_layers, num_experts, out, in]). NNX
paths map 1:1 to HF names (`hf_names.tensor_map`), e.g.
`layers/self_attn/q_proj/weight` <-> `model.layers.{i}.self_attn.q_proj.weight`.
"""

from legorl_jax.models.config import ModelConfig, UnsupportedConfigError, from_hf_config, to_hf_config
from legorl_jax.models.hf_io import CheckpointError, abstract_model, from_hf, read_hf_config, to_hf
from legorl_jax.models.kv_cache import PAD_POSITION, KVCache, init_kv_cache
from legorl_jax.models.logprobs import token_logprobs, token_logprobs_with_aux
from legorl_jax.models.sharding import MESH_AXES, batch_sharding, make_mesh, partition_spec
from legorl_jax.models.transformer import CausalLM

__all__ = [
    "MESH_AXES",
    "PAD_POSITION",
    "CausalLM",
    "CheckpointError",
    "KVCache",
    "ModelConfig",
    "UnsupportedConfigError",
    "abstract_model",
    "batch_sharding",
    "from_hf",
    "from_hf_config",
    "init_kv_cache",
    "make_mesh",
    "partition_spec",
    "read_hf_config",
    "to_hf",
    "to_hf_config",
    "token_logprobs",
    "token_logprobs_with_aux",
]
