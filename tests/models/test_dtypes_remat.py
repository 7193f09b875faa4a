"""Parameter/compute dtypes and remat policies."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from tiny_hf import VOCAB

from legorl_jax.models import CausalLM, from_hf, init_kv_cache, token_logprobs

_TOKENS = jnp.asarray(np.random.default_rng(5).integers(0, VOCAB, (2, 16), dtype=np.int32))


def _loss(model: CausalLM) -> jax.Array:
    return -token_logprobs(model, _TOKENS, chunk_size=8).mean()


@pytest.mark.parametrize("remat", ["full", "dots_saveable"])
def test_remat_keeps_gradients_and_is_applied(remat: str, tiny_hf_checkpoint: Callable[[str], Path]) -> None:
    path = tiny_hf_checkpoint("qwen3")
    plain, rematted = from_hf(path), from_hf(path, remat=remat)
    g_plain = nnx.jit(nnx.grad(_loss))(plain)
    g_remat = nnx.jit(nnx.grad(_loss))(rematted)
    for a, b in zip(jax.tree.leaves(g_plain), jax.tree.leaves(g_remat), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-5)
    # The chunked LM head is always rematerialised; the policy adds the layer body.
    assert _remat_regions(rematted) > _remat_regions(plain) >= 1


def _remat_regions(model: CausalLM) -> int:
    graphdef, state = nnx.split(model)
    jaxpr = jax.make_jaxpr(jax.grad(lambda s: _loss(nnx.merge(graphdef, s))))(state)
    return str(jaxpr).count("remat2[")


def test_bf16_params_and_compute(tiny_hf_checkpoint: Callable[[str], Path]) -> None:
    path = tiny_hf_checkpoint("qwen3")
    ref = np.asarray(from_hf(path)(_TOKENS))
    for param_dtype in ("float32", "bfloat16"):
        model = from_hf(path, dtype=param_dtype, compute_dtype="bfloat16")
        leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
        assert {x.dtype for x in leaves} == {jnp.dtype(param_dtype)}
        hidden, _ = model.hidden(_TOKENS)
        assert hidden.dtype == jnp.bfloat16
        logits = model(_TOKENS)
        assert logits.dtype == jnp.float32
        # bf16 noise, but the same function: argmax agrees almost everywhere.
        assert np.abs(np.asarray(logits) - ref).mean() < 0.1
        assert (np.asarray(logits).argmax(-1) == ref.argmax(-1)).mean() > 0.8
        assert init_kv_cache(model.config, 1, 8).k.dtype == jnp.bfloat16
