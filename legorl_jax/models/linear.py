"""The dense projection used throughout the model."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx, struct

from legorl_jax.models import cpu_kernels
from legorl_jax.models.config import ModelConfig


@struct.dataclass
class StackedWeight:
    """One layer's weight, left inside the stack of every layer's [L, ...].

    A serving step scans its layers with the projections' weights held whole
    (see `CausalLM.prepare_for_serving`): the decode kernel reads layer
    `layer` in place, where slicing it out would copy it every step.
    """

    stack: jax.Array
    layer: jax.Array


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
        # Low-rank adapters, when added (`legorl_jax/models/lora.py`): A [r, in], B [out, r].
        self.lora_a: nnx.LoRAParam | None = nnx.data(None)
        self.lora_b: nnx.LoRAParam | None = nnx.data(None)
        self.lora_scale = 0.0

    def prepare_for_serving(self) -> None:
        """Sets up the few-row products of decode steps (see `CausalLM.prepare_for_serving`).

        With the CPU kernels, a step of few rows runs `decode_matmul`, which
        streams the weight in HF's layout. Without them the weight is stored
        [in, out]: on AMD Zen 3 XLA's CPU dot is ~1.3x faster that way at 8
        and 32 rows (each row's update streams whole rows of the weight).
        Serving computes no gradients, which the kernel lacks.
        """
        if self.serving:
            return
        if self.lora_a is not None:
            raise ValueError("a projection with adapters is served merged: export the model with to_hf first")
        self.serving = True
        if not cpu_kernels.available():
            self.weight = nnx.Param(jnp.swapaxes(self.weight[...], -1, -2))  # a new row-major array
            self.input_major = True

    def __call__(self, x: jax.Array) -> jax.Array:
        cd = self.compute_dtype
        x, value = x.astype(cd), self.weight.get_value()
        if isinstance(value, StackedWeight) and not self.input_major and cpu_kernels.matmul_fits(x, value.stack):
            y = cpu_kernels.decode_matmul(x, value.stack, value.layer)
        else:
            if isinstance(value, StackedWeight):
                value = value.stack[value.layer]  # a prefill chunk: the copy is small beside its product
            pattern = "...i,io->...o" if self.input_major else "...i,oi->...o"
            y = jnp.einsum(pattern, x, value.astype(cd))
        if self.lora_a is not None and self.lora_b is not None:
            low = jnp.einsum("...i,ri->...r", x, self.lora_a[...].astype(cd))
            y = y + self.lora_scale * jnp.einsum("...r,or->...o", low, self.lora_b[...].astype(cd))
        return y if self.bias is None else y + self.bias[...].astype(cd)
