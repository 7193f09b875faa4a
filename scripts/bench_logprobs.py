#!/usr/bin/env python3
"""Peak memory of chunked `token_logprobs` vs the naive full-logits path.

Each variant runs in a fresh subprocess (so one variant's allocations cannot
hide another's) and reports two measurements:
  * xla_bytes: the compiled program's own footprint from XLA's memory
    analysis (temporaries + outputs), exact and independent of the allocator;
  * rss_bytes: the process's peak resident set (VmHWM) minus its resident set
    just before the run, i.e. what the run really added on this host.
Two scopes: `head` feeds fixed hidden states to the log-prob computation
(the part chunking changes: [T, V] logits vs [chunk, V]); `model` runs a
1-layer Qwen3 end to end, whose attention on CPU (XLA's kernel) adds a
[heads, T, T] score matrix to both variants alike; on an NVIDIA GPU with
--dtype bfloat16 the fused cuDNN kernel does not build it. On a GPU,
rss_bytes is host memory only: xla_bytes is the device figure.

  .venv/bin/python scripts/bench_logprobs.py [--seq 4096] [--vocab 151936] [--grad] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the parent process never imports jax: each measurement runs in a fresh child
    from legorl_jax.models.config import DType


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def child(variant: str, scope: str, seq: int, vocab: int, chunk: int, grad: bool, dtype: DType) -> None:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from legorl_jax.models import CausalLM, ModelConfig, token_logprobs
    from legorl_jax.models.logprobs import chunked_logprobs
    from legorl_jax.models.transformer import project_logits

    config = ModelConfig(
        architecture="qwen3", vocab_size=vocab, hidden_size=256, intermediate_size=512, num_layers=1,
        num_heads=4, num_kv_heads=2, head_dim=64, qk_norm=True, tie_word_embeddings=True,
        param_dtype=dtype, compute_dtype=dtype,
    )  # fmt: skip
    graphdef, state = nnx.split(CausalLM(config, rngs=nnx.Rngs(0)))
    tokens = jax.random.randint(jax.random.key(1), (1, seq), 0, vocab, jnp.int32)

    hidden = jax.random.normal(jax.random.key(2), (1, seq - 1, config.hidden_size), dtype)

    def logprobs(state: nnx.State) -> jax.Array:
        model = nnx.merge(graphdef, state)
        if scope == "head" and variant == "chunked":
            return chunked_logprobs(hidden, tokens[:, 1:], model.output_embedding(), temperature=1.0, chunk_size=chunk)
        if scope == "head":
            logp = jax.nn.log_softmax(project_logits(hidden, model.output_embedding()), axis=-1)
            return jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
        if variant == "chunked":
            return token_logprobs(model, tokens, chunk_size=chunk)
        logp = jax.nn.log_softmax(model(tokens), axis=-1)
        return jnp.take_along_axis(logp[:, :-1], tokens[:, 1:, None], axis=-1)[..., 0]

    fn = jax.grad(lambda s: logprobs(s).sum()) if grad else logprobs
    compiled = jax.jit(fn).lower(state).compile()
    mem = compiled.memory_analysis()
    if mem is None:
        raise SystemExit(f"{jax.default_backend()} reports no memory analysis of compiled programs")
    before = _status_kib("VmRSS")
    jax.block_until_ready(compiled(state))
    peak = _status_kib("VmHWM")
    print(json.dumps({
        "xla_bytes": mem.temp_size_in_bytes + mem.output_size_in_bytes,
        "rss_bytes": max(peak - before, 0) * 1024,
    }))  # fmt: skip


def backend() -> str:
    import jax

    return f"{jax.default_backend()} ({jax.devices()[0].device_kind})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--grad", action="store_true", help="measure the backward pass too")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="params and compute")
    parser.add_argument("--child", nargs=2, metavar=("VARIANT", "SCOPE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        variant, scope = args.child
        child(variant, scope, args.seq, args.vocab, args.chunk, args.grad, args.dtype)
        return 0
    mode = "forward+backward" if args.grad else "forward"
    print(f"token_logprobs peak memory on {backend()}, B=1 T={args.seq} V={args.vocab} chunk={args.chunk} "
          f"{args.dtype} ({mode})")  # fmt: skip
    for scope in ("head", "model"):
        results = {}
        for variant in ("naive", "chunked"):
            cmd = [sys.executable, __file__, "--child", variant, scope, "--seq", str(args.seq),
                   "--vocab", str(args.vocab), "--chunk", str(args.chunk), "--dtype", args.dtype]  # fmt: skip
            cmd += ["--grad"] if args.grad else []
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if proc.returncode:
                print(proc.stderr[-2000:], file=sys.stderr)
                return 1
            results[variant] = json.loads(proc.stdout.strip().splitlines()[-1])
        for key in ("xla_bytes", "rss_bytes"):
            naive, chunked = results["naive"][key], results["chunked"][key]
            ratio = chunked / naive if naive else float("nan")
            print(f"  {scope:5s} {key:9s}: naive {naive / 2**20:8.1f} MiB  chunked {chunked / 2**20:8.1f} MiB"
                  f"  ratio {ratio:.3f}")  # fmt: skip
    print("  target: head ratio <= 0.125")
    return 0


if __name__ == "__main__":
    sys.exit(main())
