"""Chunked token log-probabilities equal the naive full-logits computation."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from tiny_hf import VOCAB

from legorl_jax.models import CausalLM, from_hf, token_logprobs, token_logprobs_with_aux


def _naive(model: CausalLM, tokens: jax.Array, temperature: float = 1.0) -> jax.Array:
    logp = jax.nn.log_softmax(model(tokens) / temperature, axis=-1)
    return jnp.take_along_axis(logp[:, :-1], tokens[:, 1:, None], axis=-1)[..., 0]


@pytest.fixture(scope="module")
def logprob_model(tiny_hf_checkpoint: Callable[[str], Path]) -> CausalLM:
    return from_hf(tiny_hf_checkpoint("qwen3"))


@pytest.mark.parametrize(("chunk_size", "temperature"), [(7, 1.0), (64, 0.6), (10_000, 1.3)])
def test_chunked_equals_naive(logprob_model: CausalLM, chunk_size: int, temperature: float) -> None:
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, VOCAB, (3, 25), dtype=np.int32))
    got = token_logprobs(logprob_model, tokens, temperature=temperature, chunk_size=chunk_size)
    assert got.shape == (3, 24) and got.dtype == jnp.float32
    np.testing.assert_allclose(got, _naive(logprob_model, tokens, temperature), atol=2e-5, rtol=0)


def test_gradients_equal_naive(logprob_model: CausalLM) -> None:
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, VOCAB, (2, 12), dtype=np.int32))
    weights = jnp.linspace(-1.0, 1.0, 22).reshape(2, 11)

    def loss(model: CausalLM, chunked: bool) -> jax.Array:
        lp = token_logprobs(model, tokens, chunk_size=5) if chunked else _naive(model, tokens)
        return jnp.sum(lp * weights)

    g_chunked = nnx.jit(nnx.grad(lambda m: loss(m, True)))(logprob_model)
    g_naive = nnx.jit(nnx.grad(lambda m: loss(m, False)))(logprob_model)
    for a, b in zip(jax.tree.leaves(g_chunked), jax.tree.leaves(g_naive), strict=True):
        np.testing.assert_allclose(a, b, atol=2e-5, rtol=1e-4)


def test_with_aux_returns_router_loss(tiny_hf_checkpoint: Callable[[str], Path]) -> None:
    model = from_hf(tiny_hf_checkpoint("qwen3_moe"))
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, VOCAB, (2, 9), dtype=np.int32))
    lp, aux = token_logprobs_with_aux(model, tokens, chunk_size=4)
    _, ref_aux = model.hidden(tokens)
    np.testing.assert_allclose(lp, _naive(model, tokens), atol=2e-5, rtol=0)
    assert float(aux["router_aux_loss"]) == pytest.approx(float(ref_aux["router_aux_loss"]))
    assert float(aux["router_aux_loss"]) > 0


def test_bad_arguments(logprob_model: CausalLM) -> None:
    tokens = jnp.zeros((2, 5), jnp.int32)
    with pytest.raises(ValueError, match="temperature must be positive"):
        token_logprobs(logprob_model, tokens, temperature=0.0)
    with pytest.raises(ValueError, match="chunk_size must be positive"):
        token_logprobs(logprob_model, tokens, chunk_size=0)
    with pytest.raises(ValueError, match="seq >= 2"):
        token_logprobs(logprob_model, tokens[:, :1])
    with pytest.raises(ValueError, match="integer array"):
        logprob_model(jnp.zeros((2, 5), jnp.float32))
