#!/usr/bin/env python3
"""Training attention on CPU: the C++ kernel (`cpu_kernels.train_attention`) against XLA's
blockwise loops (`blockwise_attention`, the baseline), in one process.

Float32, as the demo models train. Two parts, each side timed on the same inputs
(best of --repeat after a compiling call), with the ratio kernel / XLA:

  * attention alone, forward + backward (the gradient of a random projection of
    the output): at the CLI demo model's heads (4 query, 2 KV, head_dim 32) on
    rows of --seq tokens, one sequence whole and a tree row as the CLI warm start
    packs it (a shared prompt of 85% of the row, then 8 branches that never see
    each other); and at Qwen3-8B's heads (32 / 8 / 128) on a 4,096-token row;
  * a whole SFT step's loss and gradient at the CLI demo model's shape (hidden
    128, 2 layers, vocabulary 8,192, `token_logprobs` at the branches' last 2,048 targets) on the
    tree row of the longest --seq: what one step of the CLI build computes.

The kernel's outputs and gradients are checked against XLA's in the same run
(max |diff| printed). The baseline side runs with `LEGORL_CPU_KERNELS=off`.

    PYTHONPATH=. .venv/bin/python scripts/bench_train_attention.py [--seq 4096 8192 16384] [--repeat 2]
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from legorl_jax.models import CausalLM, ModelConfig, cpu_kernels, token_logprobs
from legorl_jax.models.blockwise_attention import blockwise_attention

SIDES = ("xla", "kernel")


def best_time(fn: Callable[[], Any], repeat: int) -> float:
    jax.block_until_ready(fn())  # compiles
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return min(times)


def tree_row(seq: int, branches: int = 8) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """segment ids, kv_end and positions of one trie row: a prompt of 85% of the row, then branches."""
    prompt = int(seq * 0.85) // 64 * 64
    width = (seq - prompt) // branches
    kv_end = np.full(seq, seq, np.int32)
    positions = np.arange(seq, dtype=np.int32)
    for i in range(branches):
        start = prompt + i * width
        kv_end[start : start + width] = start + width
        positions[start : start + width] = np.arange(prompt, prompt + width)
    return np.ones(seq, np.int32)[None], kv_end[None], positions[None]


def attention_side(side: str, seg: jax.Array, kv_end: jax.Array) -> Callable[..., jax.Array]:
    if side == "kernel":
        return lambda q, k, v: cpu_kernels.train_attention(q, k, v, seg, kv_end)
    return lambda q, k, v: blockwise_attention(q, k, v, seg, kv_end, block=512)


def compare_attention(seq: int, heads: int, kv_heads: int, dim: int, layout: str, repeat: int) -> None:
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(1, seq, n, dim)), jnp.float32) for n in (heads, kv_heads, kv_heads))
    cotangent = jnp.asarray(rng.normal(size=q.shape), jnp.float32)
    if layout == "tree":
        seg, kv_end, _ = (jnp.asarray(x) for x in tree_row(seq))
    else:
        seg, kv_end = jnp.ones((1, seq), jnp.int32), jnp.full((1, seq), seq, jnp.int32)
    seconds, results = {}, {}
    for side in SIDES:
        attend = attention_side(side, seg, kv_end)
        loss = partial(lambda attend, q, k, v: (attend(q, k, v) * cotangent).sum(), attend)
        step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
        seconds[side] = best_time(partial(step, q, k, v), repeat)
        results[side] = step(q, k, v)
    diff = max(
        float(jnp.abs(a - b).max()) for a, b in zip(*(jax.tree.leaves(results[s][1]) for s in SIDES), strict=True)
    )
    print(
        f"| {heads}/{kv_heads}/{dim} | {seq:,} | {layout} | {seconds['xla']:.3f} | {seconds['kernel']:.3f} | "
        f"**{seconds['kernel'] / seconds['xla']:.2f}** | {diff:.1e} |",
        flush=True,
    )


def compare_step(seq: int, repeat: int) -> None:
    config = ModelConfig(
        architecture="qwen3", vocab_size=8192, hidden_size=128, intermediate_size=384, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=32, qk_norm=True, tie_word_embeddings=True,
    )  # fmt: skip
    seg, kv_end, positions = (jnp.asarray(x) for x in tree_row(seq))
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 8192, (1, seq)), jnp.int32)
    graphdef, state = nnx.split(CausalLM(config, rngs=nnx.Rngs(0)))

    # The step scores only its loss targets (the branches' tokens), as the build's does.
    scored = jnp.arange(seq - 1 - 2048, seq - 1, dtype=jnp.int32)[None]

    def loss(state: nnx.State) -> jax.Array:
        model = nnx.merge(graphdef, state)
        logprobs = token_logprobs(
            model, tokens, positions=positions, segment_ids=seg, kv_end=kv_end, score_index=scored
        )
        return -logprobs.sum()

    seconds, grads = {}, {}
    for side in SIDES:
        # Read when the step is traced: off keeps attend on XLA's blockwise loops.
        os.environ["LEGORL_CPU_KERNELS"] = "on" if side == "kernel" else "off"
        step = jax.jit(jax.value_and_grad(loss))
        seconds[side] = best_time(partial(step, state), repeat)
        grads[side] = jax.tree.leaves(step(state)[1])
    os.environ.pop("LEGORL_CPU_KERNELS")
    rel = max(
        float(jnp.abs(a - b).max() / jnp.abs(b).max()) for a, b in zip(grads["kernel"], grads["xla"], strict=True)
    )
    print(
        f"| CLI demo model, tree row | {seq:,} | {seconds['xla']:.2f} | {seconds['kernel']:.2f} | "
        f"**{seconds['kernel'] / seconds['xla']:.2f}** | {rel:.1e} |",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, nargs="+", default=[4096, 8192, 16384])
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    if not cpu_kernels.available():
        raise SystemExit("the CPU kernels are unavailable here (see the log): nothing to compare")
    print("| heads (q/kv/dim) | row | layout | XLA s | kernel s | kernel / XLA | max grad diff |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for seq in args.seq:
        for layout in ("whole", "tree"):
            compare_attention(seq, 4, 2, 32, layout, args.repeat)
    compare_attention(4096, 32, 8, 128, "whole", args.repeat)
    print()
    print("| step | row | XLA s | kernel s | kernel / XLA | largest gradient diff / the tensor's largest |")
    print("| --- | --- | --- | --- | --- | --- |")
    compare_step(max(args.seq), args.repeat)


if __name__ == "__main__":
    main()
