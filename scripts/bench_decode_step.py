#!/usr/bin/env python
"""Benchmark: the engine's decode step on CPU with its C++ kernels
(`legorl_jax/models/cpu_kernels.py`: decode attention and the few-row
products) against the same step on XLA alone, in one process, on random
weights at a real model's shape.

Three variants compile the model's KV-cache forward (`CausalLM.decode`, set up
as the engine serves it): with the kernels; XLA alone as the
engine runs without them (projections stored [in, out]); and XLA alone on
HF's [out, in] layout (which layout XLA prefers differs between CPUs). Each
runs `--rows` rows of one new token at `--positions` cached positions; the
rows' blocks are scattered through the pool, as they are in an engine that
has run a while. Then `--repeats` rounds alternate the variants, each round
timing `--steps` steps of each; the medians and the XLA-alone/kernels ratio
are printed. Attention alone (every layer's, no projections) is timed the
same way, and so are the step's products alone (every projection and the LM
head on the model's own weights): the kernel against torch's `linear` (MKL,
what transformers runs), in the same rounds.

    .venv/bin/python scripts/bench_decode_step.py --shape smollm2-135m --rows 8 --positions 560
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from legorl_jax.core.allocator import keep_freed_memory  # noqa: E402

keep_freed_memory()  # as `legorl serve` runs, before numpy or any thread exists

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from bench_engine import SHAPES  # noqa: E402
from flax import nnx  # noqa: E402

from legorl_jax.models import cpu_kernels, from_hf, init_kv_cache  # noqa: E402
from legorl_jax.models.attention import paged_attention  # noqa: E402
from legorl_jax.models.demo_assets import build_tiny_hf_model  # noqa: E402
from legorl_jax.models.kv_cache import LayerView  # noqa: E402
from legorl_jax.models.linear import Linear  # noqa: E402
from legorl_jax.serve.loader import BLOCK_SIZE  # noqa: E402


def timed(fn: Callable[[], Any], steps: int) -> float:
    """Milliseconds per call over `steps` calls, waiting for the last."""
    start = time.perf_counter()
    for _ in range(steps):
        out = fn()
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / steps * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-135m")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--positions", type=int, default=560, help="cached positions per row")
    parser.add_argument("--steps", type=int, default=5, help="steps timed per variant and round")
    parser.add_argument("--repeats", type=int, default=5, help="rounds, variants alternated")
    args = parser.parse_args()
    if min(args.rows, args.positions, args.steps, args.repeats) < 1:
        parser.error("--rows, --positions, --steps and --repeats must be positive")
    if not cpu_kernels.available():
        parser.error("the decode kernel is unavailable here (needs the CPU backend and a C++ compiler; see the log)")

    # Variants: (CPU kernels on while the model is set up for serving, while its step is traced).
    # Set up without them, the projections are stored [in, out] for XLA; "xla, [out, in]" keeps HF's layout.
    variants = {"kernels": (True, True), "xla": (False, False), "xla, [out, in]": (True, False)}
    real = cpu_kernels.available
    models = {}
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = build_tiny_hf_model(Path(tmp) / args.shape, **SHAPES[args.shape])
        for name, (at_setup, _) in variants.items():
            cpu_kernels.available = real if at_setup else (lambda: False)
            models[name] = from_hf(checkpoint)
            models[name].prepare_for_serving()  # as the engine serves it
            cpu_kernels.available = real
    model = models["kernels"]
    config = model.config
    width = -(-args.positions // BLOCK_SIZE)
    blocks = 1 + args.rows * width
    rng = np.random.default_rng(0)
    table = jnp.asarray(rng.permutation(np.arange(1, blocks)).reshape(args.rows, width).astype(np.int32))
    cache = init_kv_cache(config, blocks, BLOCK_SIZE)
    cache = type(cache)(k=cache.k + 0.01, v=cache.v - 0.01)  # pages touched, as a used pool's are
    tokens = jnp.asarray(rng.integers(0, config.vocab_size, (args.rows, 1)), jnp.int32)
    positions = jnp.full((args.rows, 1), args.positions - 1, jnp.int32)
    q = jnp.asarray(rng.standard_normal((args.rows, 1, config.num_heads, config.head_dim)), config.compute_dtype)

    def stepper(model: Any) -> tuple[Callable[..., tuple[Any, jax.Array]], list[jax.Array]]:
        graphdef, state = nnx.split(model)
        leaves, treedef = jax.tree.flatten(state)

        def step(leaves: list[jax.Array], cache: Any) -> tuple[Any, jax.Array]:
            model = nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))
            logits, cache = model.decode(tokens, positions, cache, table, None)
            return cache, logits

        return step, leaves

    def attention(attend: Callable[..., jax.Array]) -> Callable[[Any], jax.Array]:
        def every_layer(cache: Any) -> jax.Array:
            out = q
            for layer in range(config.num_layers):
                out = out + attend(out, LayerView(k=cache.k, v=cache.v, layer=jnp.int32(layer), table=table), positions)
            return out

        return jax.jit(every_layer)

    # Each variant is its own function: jit would reuse one function's trace for both.
    steps: dict[str, Any] = {}
    weights: dict[str, list[jax.Array]] = {}
    for name, (_, at_trace) in variants.items():
        step, weights[name] = stepper(models[name])
        cpu_kernels.available = real if at_trace else (lambda: False)  # read while tracing
        steps[name] = jax.jit(step, donate_argnums=(1,))
        cache, logits = steps[name](weights[name], cache)
        jax.block_until_ready(logits)
        cpu_kernels.available = real
    attends = {"kernels": attention(cpu_kernels.decode_attention), "xla": attention(paged_attention)}
    for fn in attends.values():
        jax.block_until_ready(fn(cache))
    products = step_products(model, args.rows)
    for product in products.values():
        product()

    rows: dict[str, dict[str, list[float]]] = {"decode step": {}, "attention, all layers": {}}
    product_runs: dict[str, list[float]] = {name: [] for name in products}
    for _ in range(args.repeats):
        for name in variants:

            def one_step(name: str = name) -> jax.Array:
                nonlocal cache
                cache, logits = steps[name](weights[name], cache)
                return logits

            rows["decode step"].setdefault(name, []).append(timed(one_step, args.steps))
            if name in attends:  # bound after the steps ran: they donate the cache they are given
                rows["attention, all layers"].setdefault(name, []).append(
                    timed(functools.partial(attends[name], cache), args.steps)
                )
        for name, product in products.items():
            product_runs[name].append(timed(product, args.steps))
    print(
        f"shape {args.shape}: {args.rows} rows x 1 new token at {args.positions} positions "
        f"({width} scattered blocks a row); medians of {args.repeats} rounds of {args.steps} steps"
    )
    print(f"{'ms':24}" + "".join(f"{name:>16}" for name in variants) + f"{'xla / kernels':>16}")
    for label, times in rows.items():
        medians = {name: statistics.median(runs) for name, runs in times.items()}
        cells = "".join(f"{medians[name]:16.1f}" if name in medians else f"{'':16}" for name in variants)
        print(f"{label:24}{cells}{medians['xla'] / medians['kernels']:15.2f}x")
    kernel_ms, torch_ms = (statistics.median(product_runs[name]) for name in ("kernels", "torch"))
    print(
        f"products alone (every projection and the LM head, {args.rows} rows): kernel {kernel_ms:.1f} ms, "
        f"torch linear (MKL) {torch_ms:.1f} ms, torch / kernel {torch_ms / kernel_ms:.2f}x"
    )
    return 0


def step_products(model: Any, rows: int) -> dict[str, Callable[[], Any]]:
    """One decode step's products, each on `rows` random rows: by the kernel (one jitted call) and by torch."""
    import torch

    # Each layer's projections are read in place from their stacks, as a serving step reads them.
    stacks = [node.weight[...] for _, node in nnx.iter_graph(model) if isinstance(node, Linear)]
    products = [(w, layer) for w in stacks for layer in range(int(w.shape[0]))]
    products.append((model.output_embedding(), 0))
    rng = np.random.default_rng(1)
    inputs = {k: rng.standard_normal((rows, k), np.float32) for k in {int(w.shape[-1]) for w, _ in products}}
    x = {k: jnp.asarray(v) for k, v in inputs.items()}
    matrices, layers = [w for w, _ in products], [i for _, i in products]
    kernel = jax.jit(
        lambda ws: [cpu_kernels.decode_matmul(x[int(w.shape[-1])], w, i) for w, i in zip(ws, layers, strict=True)]
    )
    torch_x = {k: torch.from_numpy(v) for k, v in inputs.items()}
    torch_w = [torch.from_numpy(np.array(w if w.ndim == 2 else w[i])) for w, i in products]

    def by_torch() -> list[Any]:
        with torch.inference_mode():
            return [torch.nn.functional.linear(torch_x[int(w.shape[1])], w) for w in torch_w]

    return {"kernels": lambda: kernel(matrices), "torch": by_torch}


if __name__ == "__main__":
    raise SystemExit(main())
