"""The dense projection used throughout the model."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from legorl_jax.models import cpu_kernels
from legorl_jax.models.config import ModelConfig


class Linear(nnx.Module):
    """y = x @ weight.T + bias, with weight stored [out, in] as HF checkpoints store it
    (or [in, out] for serving without the CPU kernels; see `prepare_for_serving`).

    Keeping HF's layout (instead of nnx.Linear's [in, out]) makes import,
    export and weight sync to the engine plain byte copies.
    """

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs, d_in: int, d_out: int, bias: bool) -> None:
        init = nnx.initializers.lecun_normal(in_axis=-1, out_axis=-2)
        self.weight = nnx.Param(init(rngs.params(), (d_out, d_in), config.param_dtype))
        self.bias = nnx.Param(jnp.zeros((d_out,), config.param_dtype)) if bias else None
        self.compute_dtype = jnp.dtype(config.compute_dtype)
        self.serving = False
        self.input_major = False

    def prepare_for_serving(self) -> None:
        """Sets up the few-row products of decode steps (see `CausalLM.unstack_layers`).

        With the CPU kernels, a step of few rows runs `decode_matmul`, which
        streams the weight in HF's layout. Without them the weight is stored
        [in, out]: on AMD Zen 3 XLA's CPU dot is ~1.3x faster that way at 8
        and 32 rows (each row's update streams whole rows of the weight).
        Serving computes no gradients, which the kernel lacks.
        """
        if self.serving:
            return
        self.serving = True
        if not cpu_kernels.available():
            self.weight = nnx.Param(self.weight[...].T)  # a new row-major array
            self.input_major = True

    def __call__(self, x: jax.Array) -> jax.Array:
        cd = self.compute_dtype
        x, weight = x.astype(cd), self.weight[...].astype(cd)
        if self.input_major:
            y = jnp.einsum("...i,io->...o", x, weight)
        elif self.serving and cpu_kernels.matmul_fits(x, weight):
            y = cpu_kernels.decode_matmul(x, weight)
        else:
            y = jnp.einsum("...i,oi->...o", x, weight)
        return y if self.bias is None else y + self.bias[...].astype(cd)
