#!/usr/bin/env python3
"""HF checkpoint export/import throughput, as a ratio to raw file I/O of the same bytes.

A random Qwen3 model (about 170M parameters by default) is exported with
`to_hf` and imported with `from_hf`; in the same run, the same number of bytes
is written with plain `ndarray.tofile` (from arrays already on the host) and
read back with `np.fromfile`, one file after another. Each repetition times
ours and raw back to back (which goes first alternates) and takes their ratio
(raw time / our time; 1.0 = as fast as raw I/O, target >= 0.7); the median
over --repeat pairs is reported with its spread.

What made single pairs unsteady on the 2-core VM, and what is done about it:
dirty pages of the previous write being flushed while the next operation ran
(every timed operation now starts after an untimed `sync`; writes go to
emptied directories, as a new weights version does), and the page
cache itself (with --cold, the checkpoint files are dropped from it before
every timed read, in both paths, so both read from the disk). What remains is
the cost of touching fresh memory, which both paths pay and which varies on
this VM (memory handed back to the host comes back slowly); the median of
several pairs is robust to it. Files are not fsync'ed by either writer.

  .venv/bin/python scripts/bench_hf_io.py [--dtype bfloat16] [--layers 8] [--repeat 7] [--cold] [--dir DIR]
"""

from __future__ import annotations

import argparse
import os
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

Pairs = list[tuple[float, float]]
Op = tuple[Callable[[], object], Callable[[], None]]  # (timed run, untimed preparation)


def timed(op: Op) -> float:
    run, prepare = op
    prepare()
    os.sync()
    start = time.perf_counter()
    jax.block_until_ready(run())
    return time.perf_counter() - start


def paired(repeat: int, ours: Op, raw: Op) -> Pairs:
    """Back-to-back (our time, raw time) pairs after one untimed run of each; which goes first alternates."""
    timed(ours), timed(raw)
    pairs = []
    for i in range(repeat):
        if i % 2:
            r, o = timed(raw), timed(ours)
        else:
            o, r = timed(ours), timed(raw)
        pairs.append((o, r))
    return pairs


def drop_from_cache(files: list[Path]) -> None:
    """Evict clean pages of `files` from the page cache (after the sync), so the next read hits the disk."""
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def report(name: str, gb: float, pairs: Pairs) -> None:
    ratios = np.array([r / o for o, r in pairs])
    q1, med, q3 = np.percentile(ratios, [25, 50, 75])
    ours, raw = gb / min(o for o, _ in pairs), gb / min(r for _, r in pairs)
    print(f"  {name}: best {ours:5.2f} GB/s  raw best {raw:5.2f} GB/s  paired ratio median {med:.2f} "
          f"(quartiles {q1:.2f}-{q3:.2f}, min {ratios.min():.2f})  (target >= 0.7)")  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--cold", action="store_true", help="read from the disk: drop the files from the page cache")
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

        def raw_write() -> None:
            for i, a in enumerate(host):
                a.tofile(raw / f"{i}.bin")

        def emptied(d: Path) -> Callable[[], None]:
            # Writes go to an empty directory, as publishing a new weights version does: freeing
            # the previous copy's page cache is not part of either write.
            def prepare() -> None:
                shutil.rmtree(d, ignore_errors=True)
                d.mkdir()

            return prepare

        export = paired(
            args.repeat,
            (lambda: to_hf(model, out, max_shard_bytes=args.max_shard_mb * 2**20), emptied(out)),
            (raw_write, emptied(raw)),
        )
        files = sorted(out.glob("*.safetensors"))

        def raw_read() -> list[np.ndarray]:
            return [np.fromfile(f, np.uint8) for f in files]

        prepare_read = (lambda: drop_from_cache(files)) if args.cold else (lambda: None)
        load = paired(
            args.repeat, (lambda: nnx.state(from_hf(out, dtype=args.dtype)), prepare_read), (raw_read, prepare_read)
        )
        on_disk = sum(f.stat().st_size for f in files)
    finally:
        shutil.rmtree(root)

    gb = nbytes / 1e9
    reads = "cold" if args.cold else "warm"
    print(f"HF I/O: {sum(a.size for a in host) / 1e6:.0f}M params, {args.dtype}, {gb:.2f} GB "
          f"({on_disk / 1e9:.2f} GB on disk), {args.repeat} pairs, reads {reads}")  # fmt: skip
    report("export", gb, export)
    report("import", gb, load)
    return 0


if __name__ == "__main__":
    sys.exit(main())
