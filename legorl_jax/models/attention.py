"""The attention kernel: which implementation computes softmax(q k^T) v.

`jax.nn.dot_product_attention` left to itself runs XLA's unfused
implementation everywhere (its "pick the best" default is XLA for now), which
builds the [B, N, T, S] score matrix. On an NVIDIA GPU with 16-bit
activations cuDNN's fused kernel does not; "auto" picks it there for
training-shaped calls, XLA elsewhere (TPU included: a Pallas splash-attention
path is not written yet). The boolean mask (causal, segments of packed rows,
KV-cache slots) is the same for both. `scripts/bench_attention.py` compares
the two on a GPU: agreement, speed, memory.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp

from legorl_jax.models.config import AttentionKernel

_CUDNN_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def resolve_kernel(kernel: AttentionKernel, dtype: jnp.dtype, head_dim: int) -> Literal["xla", "cudnn"]:
    """The implementation `kernel` stands for on this process's default backend."""
    if kernel == "cudnn" and jax.default_backend() != "gpu":
        raise ValueError(f"attention_kernel='cudnn' needs an NVIDIA GPU; this process runs on {jax.default_backend()}")
    if kernel != "auto":
        return kernel
    if jax.default_backend() != "gpu" or jnp.dtype(dtype) not in _CUDNN_DTYPES:
        return "xla"
    # cuDNN's fused attention needs head_dim a multiple of 8 up to 128 and an Ampere or newer GPU.
    capability = getattr(jax.devices()[0], "compute_capability", "0")
    if head_dim % 8 or head_dim > 128 or float(capability) < 8.0:
        return "xla"
    return "cudnn"


def attend(
    q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, *, kernel: AttentionKernel, causal: bool
) -> jax.Array:
    """q[B, T, N, H], k/v[B, S, K, H] (N a multiple of K), mask bool[B, 1, T, S] -> [B, T, N, H].

    `causal` says the mask already holds the causal triangle with queries and
    keys aligned at index 0 (no KV cache): cuDNN then skips the blocks above
    the diagonal instead of computing and masking them.
    """
    # A KV-cache step (the embedded engine's decode) stays on XLA under "auto": training is where long
    # rows make the fused kernel pay, and serving on GPU hosts is vLLM's.
    impl = resolve_kernel(kernel, q.dtype, q.shape[-1]) if causal or kernel != "auto" else "xla"
    k, v = k.astype(q.dtype), v.astype(q.dtype)
    if impl == "xla":
        return jax.nn.dot_product_attention(q, k, v, mask=mask, implementation="xla")
    return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=causal, implementation="cudnn")
