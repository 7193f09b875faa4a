"""Which attention implementation runs, and that asking for one that cannot is a clear error."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from legorl_jax.models import CausalLM, ModelConfig
from legorl_jax.models.attention import attend, resolve_kernel


def test_auto_is_xla_off_gpu_and_cudnn_needs_a_gpu() -> None:
    assert jax.default_backend() == "cpu"
    assert resolve_kernel("auto", jnp.bfloat16, 128) == "xla"
    assert resolve_kernel("xla", jnp.bfloat16, 128) == "xla"
    with pytest.raises(ValueError, match="cudnn.*needs an NVIDIA GPU"):
        resolve_kernel("cudnn", jnp.bfloat16, 128)


def test_kernel_choice_reaches_every_layer() -> None:
    config = ModelConfig(
        architecture="qwen3", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True, attention_kernel="cudnn",
    )  # fmt: skip
    model = CausalLM(config, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="needs an NVIDIA GPU"):
        model(jnp.zeros((1, 4), jnp.int32))
    model = CausalLM(config.replace(attention_kernel="xla"), rngs=nnx.Rngs(0))
    assert np.isfinite(np.asarray(model(jnp.zeros((1, 4), jnp.int32)))).all()


def test_attend_masks_and_groups_heads_like_a_reference() -> None:
    rng = np.random.default_rng(0)
    b, t, n, kv, h = 2, 6, 4, 2, 8
    q = jnp.asarray(rng.normal(size=(b, t, n, h)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(b, t, kv, h)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(b, t, kv, h)), jnp.float32)
    segments = jnp.asarray([[1, 1, 1, 2, 2, 0], [1, 1, 1, 1, 1, 1]])
    mask = (jnp.tril(jnp.ones((t, t), bool))[None] & (segments[:, :, None] == segments[:, None, :]))[:, None]
    out = attend(q, k, v, mask, kernel="auto", causal=True)
    kr, vr = jnp.repeat(k, n // kv, axis=2), jnp.repeat(v, n // kv, axis=2)
    scores = jnp.einsum("btnh,bsnh->bnts", q, kr) / np.sqrt(h)
    weights = jax.nn.softmax(jnp.where(mask, scores, -jnp.inf), axis=-1)
    np.testing.assert_allclose(out, jnp.einsum("bnts,bsnh->btnh", weights, vr), atol=1e-5)
