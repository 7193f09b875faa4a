"""The dense projection used throughout the model."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from legorl_jax.models.config import ModelConfig


class Linear(nnx.Module):
    """y = x @ weight.T + bias, with weight stored [out, in] as HF checkpoints store it
    (or [in, out] once `make_input_major` has run, for serving).

    Keeping HF's layout (instead of nnx.Linear's [in, out]) makes import,
    export and weight sync to the engine plain byte copies; the engine
    transposes once when it loads, for its few-row steps.
    """

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs, d_in: int, d_out: int, bias: bool) -> None:
        init = nnx.initializers.lecun_normal(in_axis=-1, out_axis=-2)
        self.weight = nnx.Param(init(rngs.params(), (d_out, d_in), config.param_dtype))
        self.bias = nnx.Param(jnp.zeros((d_out,), config.param_dtype)) if bias else None
        self.compute_dtype = jnp.dtype(config.compute_dtype)
        self.input_major = False

    def make_input_major(self) -> None:
        """Stores the weight [in, out] from now on (serving; see `CausalLM.unstack_layers`).

        XLA on CPU multiplies a few rows by an [in, out] matrix about 1.3x
        faster than by [out, in] (measured at 8 and 32 rows, SmolLM2 and
        Qwen3 shapes): each row's update then streams whole rows of the weight.
        """
        if not self.input_major:
            self.weight = nnx.Param(self.weight[...].T)  # a new row-major array
            self.input_major = True

    def __call__(self, x: jax.Array) -> jax.Array:
        cd = self.compute_dtype
        spec = "...i,io->...o" if self.input_major else "...i,oi->...o"
        y = jnp.einsum(spec, x.astype(cd), self.weight[...].astype(cd))
        return y if self.bias is None else y + self.bias[...].astype(cd)
