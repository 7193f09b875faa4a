#!/usr/bin/env python3
"""The attention kernel "auto" picks vs XLA's, in one process: agreement, speed, memory.

On an NVIDIA GPU with bf16 compute, "auto" is cuDNN's fused kernel; on CPU
(and for float32 on a GPU) it is blockwise attention for rows of two or more
tiles. This measures, against the XLA implementation in the same run:
  * agreement on packed rows (causal + segment mask, GQA): max |diff| of the
    outputs and of the gradients w.r.t. q, k, v;
  * attention alone, forward + backward, at Qwen3-8B's head shapes
    (32 query heads, 8 KV heads, head_dim 128): median step time ratio and
    the compiled programs' temporary memory;
  * a whole model's log-prob gradient (`token_logprobs`, 2 layers, hidden 1024,
    V = 151,936): time ratio and peak device memory (allocator statistics).
Where "auto" is XLA itself there is nothing to compare; the script says so.

  python scripts/bench_attention.py [--seq 4096] [--batch 1] [--repeat 10] [--vocab 151936] [--hidden 1024]
      [--dtype bfloat16|float32]

--vocab and --hidden shrink the whole model, for a dry run that only checks the script.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from legorl_jax.models import CausalLM, ModelConfig, token_logprobs  # noqa: E402
from legorl_jax.models.attention import attend, resolve_kernel  # noqa: E402
from legorl_jax.models.config import AttentionKernel  # noqa: E402

KERNELS: tuple[AttentionKernel, ...] = ("xla", "auto")


def temp_bytes(compiled: Any) -> int:
    """The compiled program's temporary device memory."""
    analysis = compiled.memory_analysis()
    if analysis is None:
        raise SystemExit(f"{jax.default_backend()} reports no memory analysis of compiled programs")
    return int(analysis.temp_size_in_bytes)


def median_time(fn: Callable[[], Any], repeat: int) -> float:
    jax.block_until_ready(fn())
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def packed_segments(batch: int, seq: int) -> jax.Array:
    """Each row packs segments of a few lengths, then padding (segment 0)."""
    segments = np.zeros((batch, seq), np.int32)
    for row in range(batch):
        start, sid = 0, 1
        for length in (seq // 2, seq // 4, seq // 8):
            segments[row, start : start + length] = sid
            start, sid = start + length, sid + 1
    return jnp.asarray(segments)


def attention_loss(
    kernel: AttentionKernel, segments: jax.Array
) -> Callable[[jax.Array, jax.Array, jax.Array], jax.Array]:
    def loss(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        return attend(q, k, v, segments, kernel=kernel).astype(jnp.float32).sum()

    return loss


def compare_attention(args: argparse.Namespace) -> None:
    b, t, n, kv, h = args.batch, args.seq, 32, 8, 128
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (b, t, n, h), args.dtype)
    k = jax.random.normal(keys[1], (b, t, kv, h), args.dtype)
    v = jax.random.normal(keys[2], (b, t, kv, h), args.dtype)
    segments = packed_segments(b, t)
    results: dict[str, dict[str, Any]] = {}
    for kernel in KERNELS:
        fn = jax.jit(jax.value_and_grad(attention_loss(kernel, segments), argnums=(0, 1, 2)))
        compiled = fn.lower(q, k, v).compile()
        out = jax.jit(lambda q, k, v, kernel=kernel: attend(q, k, v, segments, kernel=kernel))(q, k, v)
        results[kernel] = {
            "out": np.asarray(out, np.float32),
            "grads": [np.asarray(g, np.float32) for g in compiled(q, k, v)[1]],
            "time": median_time(partial(compiled, q, k, v), args.repeat),
            "temp": temp_bytes(compiled),
        }
    x, a = results["xla"], results["auto"]
    print(f"attention alone, B={b} T={t} heads 32/8 head_dim 128, {args.dtype}, packed rows, forward + backward:")
    grad_diffs = " / ".join(f"{np.abs(gx - ga).max():.4f}" for gx, ga in zip(x["grads"], a["grads"], strict=True))
    print(f"  max |out diff| {np.abs(x['out'] - a['out']).max():.4f} (outputs up to {np.abs(x['out']).max():.2f}); "
          f"max |grad diff| q/k/v {grad_diffs}")  # fmt: skip
    speedup = x["time"] / a["time"]
    print(f"  step time xla {x['time'] * 1e3:.2f} ms, auto {a['time'] * 1e3:.2f} ms: auto is {speedup:.1f}x faster")
    print(f"  compiled temporaries xla {x['temp'] / 2**20:.0f} MiB, auto {a['temp'] / 2**20:.0f} MiB")


def model_step(kernel: AttentionKernel, args: argparse.Namespace) -> tuple[float, int]:
    """Median time and compiled temporaries of a whole model's log-prob gradient."""
    config = ModelConfig(
        architecture="qwen3", vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
        num_layers=2,
        num_heads=16, num_kv_heads=8, head_dim=128, qk_norm=True, tie_word_embeddings=True,
        param_dtype=args.dtype, compute_dtype=args.dtype, attention_kernel=kernel,
    )  # fmt: skip
    graphdef, state = nnx.split(CausalLM(config, rngs=nnx.Rngs(0)))
    tokens = jax.random.randint(jax.random.key(1), (args.batch, args.seq), 0, config.vocab_size, jnp.int32)

    def loss(state: nnx.State) -> jax.Array:
        return token_logprobs(nnx.merge(graphdef, state), tokens).sum()

    step = jax.jit(jax.grad(loss)).lower(state).compile()
    return median_time(partial(step, state), args.repeat), temp_bytes(step)


def compare_model(args: argparse.Namespace) -> None:
    (t_xla, m_xla), (t_auto, m_auto) = [model_step(kernel, args) for kernel in KERNELS]
    print(
        f"whole model, token_logprobs gradient, 2 layers, hidden {args.hidden}, V={args.vocab:,}, "
        f"B={args.batch} T={args.seq}, {args.dtype}:"
    )
    print(f"  step time xla {t_xla * 1e3:.1f} ms, auto {t_auto * 1e3:.1f} ms: auto is {t_xla / t_auto:.2f}x faster")
    print(f"  compiled temporaries xla {m_xla / 2**20:.0f} MiB, auto {m_auto / 2**20:.0f} MiB ({m_auto / m_xla:.2f}x)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--vocab", type=int, default=151_936, help="the whole model's vocabulary (Qwen3's)")
    parser.add_argument("--hidden", type=int, default=1024, help="the whole model's hidden size (MLP: 3x)")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--dry-run", action="store_true", help="compare even where auto is XLA (checks the script)")
    args = parser.parse_args()
    chosen = resolve_kernel("auto", jnp.dtype(args.dtype), 128, args.seq)
    print(f"backend {jax.default_backend()} ({jax.devices()[0].device_kind}): auto -> {chosen}")
    if chosen == "xla" and not args.dry_run:
        print("auto is XLA's kernel on this backend: nothing to compare")
        return 0
    compare_attention(args)
    compare_model(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
