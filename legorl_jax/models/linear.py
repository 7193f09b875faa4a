"""The dense projection used throughout the model."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from legorl_jax.models.config import ModelConfig


class Linear(nnx.Module):
    """y = x @ weight.T + bias, with weight stored [out, in] as HF checkpoints store it.

    Keeping HF's layout (instead of nnx.Linear's [in, out]) makes import,
    export and weight sync to the engine plain byte copies; XLA contracts
    either layout natively.
    """

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs, d_in: int, d_out: int, bias: bool) -> None:
        init = nnx.initializers.lecun_normal(in_axis=-1, out_axis=-2)
        self.weight = nnx.Param(init(rngs.params(), (d_out, d_in), config.param_dtype))
        self.bias = nnx.Param(jnp.zeros((d_out,), config.param_dtype)) if bias else None
        self.compute_dtype = jnp.dtype(config.compute_dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        cd = self.compute_dtype
        y = jnp.einsum("...i,oi->...o", x.astype(cd), self.weight[...].astype(cd))
        return y if self.bias is None else y + self.bias[...].astype(cd)
