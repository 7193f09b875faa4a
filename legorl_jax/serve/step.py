"""The engine's one device program: run a chunk of tokens for every slot through
the model's KV-cache decode, then sample the next token of each slot.

Chunked prefill and decode are the same call: a slot still reading its prompt
contributes up to C tokens, a decoding slot contributes one, and the rest of the
row is padding (position -1). Attention reads only the W blocks of each row's
block table. Shapes depend only on (rows, chunk, window) buckets, so a handful
of buckets means a handful of compilations; the pool is donated and updated in
place.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from legorl_jax.serve.protocol import MAX_LOGPROBS
from legorl_jax.serve.sampling import sample, target_logprobs


@dataclasses.dataclass(frozen=True)
class StepInputs:
    """Host-side arrays of one step over the leading S cache rows; chunk C."""

    tokens: np.ndarray  # i32[S, C]
    positions: np.ndarray  # i32[S, C], -1 = padding
    block_table: np.ndarray  # i32[S, W], pool blocks of each row's window
    last: np.ndarray  # i32[S], chunk index whose logits are sampled from
    targets: np.ndarray  # i32[S, C], next prompt token per position (-1: none)
    temperature: np.ndarray  # f32[S]
    top_k: np.ndarray  # i32[S]
    top_p: np.ndarray  # f32[S]
    seeds: np.ndarray  # u32[S]
    counters: np.ndarray  # i32[S], index of the token being sampled in its request


@dataclasses.dataclass(frozen=True)
class StepOutputs:
    token: np.ndarray  # i32[S]
    logprob: np.ndarray  # f32[S]
    top_ids: np.ndarray | None  # i32[S, MAX_LOGPROBS]
    top_logprobs: np.ndarray | None  # f32[S, MAX_LOGPROBS]
    prompt_logprob: np.ndarray | None  # f32[S, C]
    prompt_rank: np.ndarray | None  # i32[S, C]
    prompt_top_ids: np.ndarray | None  # i32[S, C, MAX_LOGPROBS]
    prompt_top_logprobs: np.ndarray | None  # f32[S, C, MAX_LOGPROBS]


def _device_step(
    graphdef: nnx.GraphDef,
    treedef: Any,
    leaves: list[jax.Array],
    cache: Any,
    inputs: dict[str, jax.Array],
    want_top: bool,
    want_prompt: bool,
) -> tuple[Any, dict[str, jax.Array]]:
    model = nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))
    # Without prompt logprobs only the sampled position's logits are needed.
    last = None if want_prompt else inputs["last"]
    logits, cache = model.decode(inputs["tokens"], inputs["positions"], cache, inputs["block_table"], last)
    if want_prompt:
        last_logits = jnp.take_along_axis(logits, inputs["last"][:, None, None], axis=1)[:, 0]
    else:
        last_logits = logits[:, 0]
    token, logprob, logprobs = sample(
        last_logits,
        inputs["temperature"],
        inputs["top_k"],
        inputs["top_p"],
        inputs["seeds"],
        inputs["counters"],
    )
    out = {"token": token, "logprob": logprob}
    if want_top:
        out["top_logprobs"], out["top_ids"] = jax.lax.top_k(logprobs, MAX_LOGPROBS)
    if want_prompt:
        prompt = target_logprobs(logits, inputs["targets"], inputs["temperature"], MAX_LOGPROBS)
        out["prompt_logprob"], out["prompt_rank"], out["prompt_top_logprobs"], out["prompt_top_ids"] = prompt
    return cache, out


@dataclasses.dataclass(frozen=True)
class CompiledStep:
    """One step shape's program with its weights and inputs bound: what a
    benchmark inspects (`program.memory_analysis()`) and times (`run`)."""

    program: Any  # jax.stages.Compiled
    leaves: list[jax.Array]
    arrays: dict[str, np.ndarray]

    def run(self, cache: Any) -> tuple[Any, dict[str, jax.Array]]:
        """(new cache, outputs); the cache passed in is donated."""
        return self.program(self.leaves, cache, self.arrays)


class DeviceStep:
    """Compiled engine step for one model graph. Weights (`state`) are an
    argument, so a reload with the same architecture reuses the compilation."""

    def __init__(self, graphdef: nnx.GraphDef) -> None:
        self._graphdef = graphdef
        self._state: nnx.State | None = None
        self._leaves: list[jax.Array] = []
        self._treedef: Any = None
        self._jitted: Any = None

    def _adopt(self, state: nnx.State) -> None:
        """Flattens the weights once per installed version, not once per step.

        The graph and the tree structure are bound into the compiled function
        rather than passed as static arguments: jit would hash them on every
        call, and for a model of hundreds of weight arrays that hashing and the
        State's flattening cost tens of milliseconds a step.
        """
        leaves, treedef = jax.tree.flatten(state)
        if self._treedef is None or treedef != self._treedef:
            step = functools.partial(_device_step, self._graphdef, treedef)
            # The cache is donated: it is rewritten every step and never read again.
            self._jitted = jax.jit(step, static_argnums=(3, 4), donate_argnums=(1,))
            self._treedef = treedef
        self._state, self._leaves = state, leaves

    def compiled(
        self, state: nnx.State, cache: Any, inputs: StepInputs, want_top: bool, want_prompt: bool
    ) -> CompiledStep:
        """The program `__call__` would compile for these shapes, compiled apart from its cache."""
        if state is not self._state:
            self._adopt(state)
        arrays = _arrays(inputs)
        program = self._jitted.lower(self._leaves, cache, arrays, want_top, want_prompt).compile()
        return CompiledStep(program, self._leaves, arrays)

    def __call__(
        self, state: nnx.State, cache: Any, inputs: StepInputs, want_top: bool, want_prompt: bool
    ) -> tuple[Any, StepOutputs]:
        if state is not self._state:
            self._adopt(state)
        cache, out = self._jitted(self._leaves, cache, _arrays(inputs), want_top, want_prompt)
        # One device->host transfer per step for the whole batch.
        host = jax.device_get(out)
        return cache, StepOutputs(
            token=host["token"],
            logprob=host["logprob"],
            top_ids=host.get("top_ids"),
            top_logprobs=host.get("top_logprobs"),
            prompt_logprob=host.get("prompt_logprob"),
            prompt_rank=host.get("prompt_rank"),
            prompt_top_ids=host.get("prompt_top_ids"),
            prompt_top_logprobs=host.get("prompt_top_logprobs"),
        )


def _arrays(inputs: StepInputs) -> dict[str, np.ndarray]:
    # Host arrays go to the jitted call as they are: its C++ dispatch moves
    # them to the device, cheaper than one jnp.asarray each.
    return {f.name: getattr(inputs, f.name) for f in dataclasses.fields(inputs)}
