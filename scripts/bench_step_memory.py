#!/usr/bin/env python
"""Benchmark: where the engine's resident memory goes, step program by step program.

`legorl serve` holds its weights, its KV pool, and one compiled program per step
shape (rows, chunk, window blocks) it has met. This builds random weights at a
real shape, the pool at `legorl serve`'s default size, and for each `--steps`
shape compiles the engine's step program and prints, in MB: what the program
keeps resident once compiled (measured after returning freed pages to the
system), XLA's temporary buffers for one run of it (`memory_analysis`), what a
run leaves resident, and the run's median time. The first line is the same
process's baseline: resident memory after import, the weights and the pool. The
last adds them up: baseline + every program + the largest temporaries, about
the peak of an engine that has met these shapes.

    .venv/bin/python scripts/bench_step_memory.py --shape smollm2-135m --steps 32x1x17 32x64x17 16x64x17
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from legorl_jax.core.allocator import keep_freed_memory, release_freed_memory  # noqa: E402

keep_freed_memory()  # before any thread exists, as `legorl` does

import numpy as np  # noqa: E402
from bench_engine import SHAPES  # noqa: E402

from legorl_jax.serve.loader import BLOCK_SIZE  # noqa: E402


def resident_mb() -> float:
    """This process's resident memory now, after giving freed pages back (what it holds)."""
    release_freed_memory()
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


def step_shape(text: str) -> tuple[int, int, int]:
    try:
        rows, chunk, window = (int(part) for part in text.split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected ROWSxCHUNKxWINDOW, e.g. 32x1x17") from None
    if min(rows, chunk, window) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: rows, chunk and window blocks must be positive")
    return rows, chunk, window


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-135m")
    parser.add_argument(
        "--steps",
        type=step_shape,
        nargs="+",
        default=[(32, 1, 17), (32, 64, 8), (32, 64, 17), (16, 64, 17)],
        help="step shapes ROWSxCHUNKxWINDOW (window in 32-position blocks)",
    )
    parser.add_argument("--runs", type=int, default=3, help="timed runs per shape (median)")
    args = parser.parse_args()
    if args.runs < 1:
        parser.error(f"--runs must be positive, got {args.runs}")
    for rows, chunk, window in args.steps:
        if window * BLOCK_SIZE < chunk:
            parser.error(f"{rows}x{chunk}x{window}: a chunk of {chunk} does not fit a window of {window} blocks")

    import jax
    from flax import nnx

    from legorl_jax.models import from_hf, init_kv_cache
    from legorl_jax.serve.loader import DEFAULT_MAX_NUM_SEQS, pool_blocks
    from legorl_jax.serve.step import DeviceStep, StepInputs

    shape = SHAPES[args.shape]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / args.shape
        # In a child: building it imports torch, which this process, like the engine's, must not hold.
        build = "from legorl_jax.models.demo_assets import build_tiny_hf_model as build; "
        build += f"build({str(model_dir)!r}, **{shape!r})"
        subprocess.run([sys.executable, "-c", build], cwd=REPO, check=True, capture_output=True)
        runtime = resident_mb()
        model = from_hf(model_dir)
        model.prepare_for_serving()  # as the engine serves
        graphdef, state = nnx.split(model)
        config = model.config
        del model
        weights = resident_mb() - runtime
        max_len = shape["max_position_embeddings"]
        blocks = pool_blocks(state, config, config.compute_dtype, None, DEFAULT_MAX_NUM_SEQS, max_len)
        cache = jax.block_until_ready(init_kv_cache(config, blocks, BLOCK_SIZE))
        pool = resident_mb() - runtime - weights
    print(
        f"{args.shape}: runtime {runtime:.0f} MB, weights {weights:.0f} MB, pool {pool:.0f} MB "
        f"({blocks} blocks of {BLOCK_SIZE}), total {runtime + weights + pool:.0f} MB",
        flush=True,
    )
    step = DeviceStep(graphdef)
    rng = np.random.default_rng(0)
    kept_total, temp_max = 0.0, 0.0
    print(f"{'rows x chunk x window':>22} {'compile_s':>9} {'kept_MB':>8} {'temp_MB':>8} {'held_MB':>8} {'run_ms':>8}")
    for rows, chunk, window in args.steps:
        # Each row's blocks scattered through the pool, as in an engine that has run a while.
        table = (rng.permutation(rows * window) % (blocks - 1) + 1).reshape(rows, window).astype(np.int32)
        start = window * BLOCK_SIZE - chunk  # the chunk ends the window: attention reads all of it
        inputs = StepInputs(
            tokens=rng.integers(300, config.vocab_size, (rows, chunk)).astype(np.int32),
            positions=np.tile(np.arange(start, start + chunk, dtype=np.int32), (rows, 1)),
            block_table=table,
            last=np.full(rows, chunk - 1, np.int32),
            targets=np.full((rows, chunk), -1, np.int32),
            temperature=np.ones(rows, np.float32),
            top_k=np.full(rows, -1, np.int32),
            top_p=np.ones(rows, np.float32),
            seeds=np.zeros(rows, np.uint32),
            counters=np.zeros(rows, np.int32),
        )
        before = resident_mb()
        began = time.perf_counter()
        compiled = step.compiled(state, cache, inputs, want_top=False, want_prompt=False)
        compile_s = time.perf_counter() - began
        kept = resident_mb() - before
        temp = compiled.program.memory_analysis().temp_size_in_bytes / 2**20
        times = []
        for _ in range(args.runs):
            began = time.perf_counter()
            cache, out = compiled.run(cache)
            jax.block_until_ready(out)
            times.append(time.perf_counter() - began)
        held = resident_mb() - before - kept
        kept_total, temp_max = kept_total + kept, max(temp_max, temp)
        label = f"{rows}x{chunk}x{window}"
        median_ms = 1000 * statistics.median(times)
        print(f"{label:>22} {compile_s:9.1f} {kept:8.0f} {temp:8.0f} {held:8.0f} {median_ms:8.0f}", flush=True)
    estimate = runtime + weights + pool + kept_total + temp_max
    print(
        f"baseline {runtime + weights + pool:.0f} + programs {kept_total:.0f} + largest temporaries {temp_max:.0f} "
        f"= {estimate:.0f} MB"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
