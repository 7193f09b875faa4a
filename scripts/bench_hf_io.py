#!/usr/bin/env python3
"""HF checkpoint export/import throughput, as a ratio to raw file I/O of the same bytes.

A random Qwen3 model (about 170M parameters by default) is exported with
`to_hf` and imported with `from_hf`; in the same run, the same number of bytes
is written with plain `ndarray.tofile` (from arrays already on the host) and
read back with `np.fromfile`. Each repetition times ours and raw back to back
and takes their ratio (raw time / our time; 1.0 = as fast as raw I/O, target
>= 0.7); the median ratio over --repeat pairs is reported, which is robust to
other load on a shared machine. Files are not fsync'ed in either path, so
both measure the same page-cache I/O.

  .venv/bin/python scripts/bench_hf_io.py [--dtype bfloat16] [--layers 8] [--repeat 3]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from legorl_jax.models import CausalLM, ModelConfig, from_hf, to_hf


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - start


def paired(repeat: int, ours: Callable[[], object], raw: Callable[[], object]) -> tuple[float, float, float]:
    """(median raw/ours ratio, best our time, best raw time) over back-to-back pairs."""
    pairs = [(timed(ours), timed(raw)) for _ in range(repeat)]
    return (
        float(np.median([r / o for o, r in pairs])),
        min(o for o, _ in pairs),
        min(r for _, r in pairs),
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--max-shard-mb", type=int, default=100, help="shard size, so the index path is exercised")
    parser.add_argument("--dir", type=Path, default=None, help="scratch directory (default: a temp dir)")
    args = parser.parse_args()

    h = args.hidden
    config = ModelConfig(
        architecture="qwen3", vocab_size=args.vocab, hidden_size=h, intermediate_size=3 * h, num_layers=args.layers,
        num_heads=16, num_kv_heads=8, head_dim=h // 16, qk_norm=True, param_dtype=args.dtype, compute_dtype=args.dtype,
    )  # fmt: skip
    model = CausalLM(config, rngs=nnx.Rngs(0))
    host = [np.asarray(x) for x in jax.tree.leaves(nnx.state(model, nnx.Param))]
    nbytes = sum(a.nbytes for a in host)
    root = Path(tempfile.mkdtemp(dir=args.dir))
    try:
        out, raw = root / "hf", root / "raw"
        raw.mkdir()

        def raw_write() -> None:
            for i, a in enumerate(host):
                a.tofile(raw / f"{i}.bin")

        def raw_read() -> list[np.ndarray]:
            return [np.fromfile(f, np.uint8) for f in sorted(out.glob("*.safetensors"))]

        export = paired(args.repeat, lambda: to_hf(model, out, max_shard_bytes=args.max_shard_mb * 2**20), raw_write)
        load = paired(args.repeat, lambda: nnx.state(from_hf(out, dtype=args.dtype)), raw_read)
        on_disk = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    finally:
        shutil.rmtree(root)

    gb = nbytes / 1e9
    print(f"HF I/O: {sum(a.size for a in host) / 1e6:.0f}M params, {args.dtype}, {gb:.2f} GB "
          f"({on_disk / 1e9:.2f} GB on disk), {args.repeat} pairs")  # fmt: skip
    for name, (ratio, ours, raw_t) in (("export", export), ("import", load)):
        print(f"  {name}: best {gb / ours:5.2f} GB/s  raw best {gb / raw_t:5.2f} GB/s  "
              f"median paired ratio {ratio:.2f}  (target >= 0.7)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
