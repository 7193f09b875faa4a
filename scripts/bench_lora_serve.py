#!/usr/bin/env python3
"""LoRA on the embedded engine: adapters merged into the served weights against
applied unmerged, and an adapter version against a full one.

In one process, on a random Qwen3 of `--size` (bench_learner's shapes) with
rank-`--rank` adapters (random non-zero B) on all seven projections:
1. Decode step time (8 rows, one token each, median of `--steps`): the base
   as the engine serves it (`prepare_for_serving`), the adapters merged then
   served the same way, and the adapters applied unmerged (the model's own
   adapter-carrying forward; it cannot be prepared, so the base unprepared is
   printed beside it). Then the seconds to apply an update each way: merged
   (copy of the base, `load_peft`, `merge_adapters`, prepare) and unmerged
   (`load_peft` onto a copy of the base).
2. A version published and loaded into a running embedded engine (HTTP,
   `update_weights`: pause, reload, reset prefix cache, label, resume):
   the adapter (`DirectoryPublisher(adapter_base=...)`, merged by the engine)
   against the merged full checkpoint, bytes and median seconds.

    .venv/bin/python scripts/bench_lora_serve.py [--size 100m] [--rank 32] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_learner import SIZES  # noqa: E402 (the scripts directory first)
from bench_lora_publish import TARGETS, adapted, dir_bytes  # noqa: E402

ROWS = 8


def median_s(run: Callable[[], Any], repeats: int) -> float:
    run()  # compile / warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def decode_step_s(model: Any, steps: int) -> float:
    """Median seconds of one decode step of ROWS rows at position 64 (cache of 128)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from legorl_jax.models import init_kv_cache

    cache = init_kv_cache(model.config, ROWS, 128)
    tokens = jnp.ones((ROWS, 1), jnp.int32)
    positions = jnp.full((ROWS, 1), 64, jnp.int32)
    step = nnx.jit(lambda m, t, p, c: m.decode(t, p, c)[0])
    return median_s(lambda: jax.block_until_ready(step(model, tokens, positions, cache)), steps)


def serving_costs(base_dir: Path, adapter_dir: Path, steps: int) -> dict[str, float]:
    import jax
    from flax import nnx

    from legorl_jax.models import from_hf
    from legorl_jax.models.lora import load_peft, merge_adapters

    base = nnx.split(from_hf(base_dir))

    def merged() -> Any:
        model = merge_adapters(load_peft(nnx.merge(*base, copy=True), adapter_dir))
        model.prepare_for_serving()
        return jax.block_until_ready(model)

    def unmerged() -> Any:
        return jax.block_until_ready(load_peft(nnx.merge(*base, copy=True), adapter_dir))

    prepared = nnx.merge(*base, copy=True)
    prepared.prepare_for_serving()
    return {
        "decode base (served)": decode_step_s(prepared, steps),
        "decode merged (served)": decode_step_s(merged(), steps),
        "decode base (unprepared)": decode_step_s(nnx.merge(*base, copy=True), steps),
        "decode unmerged": decode_step_s(unmerged(), steps),
        "update merged": median_s(merged, 3),
        "update unmerged": median_s(unmerged, 3),
    }


def publish_costs(base_dir: Path, root: Path, rank: int, rounds: int) -> dict[str, dict[str, float]]:
    """Median publish and load seconds and bytes of each way, versions alternating in order."""
    from legorl_jax.serve.server import EmbeddedEngine
    from legorl_jax.train.publish import DirectoryPublisher
    from rollout_server.backends.client import SyncEngineClient

    publishers = {
        "adapter": DirectoryPublisher(root / "adapter", adapter_base=base_dir),
        "full": DirectoryPublisher(root / "full", tokenizer_from=base_dir),
    }
    runs: dict[str, list[tuple[float, float, int]]] = {kind: [] for kind in publishers}
    with EmbeddedEngine.start(base_dir, max_slots=ROWS, max_len=256) as engine:
        client = SyncEngineClient(engine.url, timeout=600)
        try:
            for version in range(1, rounds + 2):  # version 1 warms both up
                model = adapted(base_dir, rank, version)
                for kind in sorted(publishers, reverse=version % 2 == 0):
                    start = time.perf_counter()
                    location = publishers[kind].publish(model, version)
                    published = time.perf_counter()
                    client.update_weights(location, version=str(version))
                    if version > 1:
                        runs[kind].append(
                            (published - start, time.perf_counter() - published, dir_bytes(Path(location)))
                        )
        finally:
            client.close()
    return {
        kind: {"publish": statistics.median(r[0] for r in rs), "load": statistics.median(r[1] for r in rs),
               "bytes": rs[-1][2]}
        for kind, rs in runs.items()
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SIZES), default="100m")
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--steps", type=int, default=20, help="decode steps timed per variant")
    parser.add_argument("--rounds", type=int, default=3, help="versions published each way")
    args = parser.parse_args()

    from legorl_jax.models.demo_assets import build_tiny_hf_model
    from legorl_jax.models.lora import save_peft

    shape = dict(SIZES[args.size])
    root = Path(tempfile.mkdtemp(prefix="bench-lora-serve-"))
    base = build_tiny_hf_model(root / "base", seed=0, max_position_embeddings=1024, **shape)
    adapter_dir = save_peft(adapted(base, args.rank, 0), root / "adapter0")
    print(f"{args.size}, rank {args.rank} on {', '.join(TARGETS)}, {ROWS} rows per decode step, float32")
    serving = serving_costs(base, adapter_dir, args.steps)
    for name, seconds in serving.items():
        print(f"{name:26s} {1000 * seconds:9.2f} ms")
    print(f"unmerged / merged decode: {serving['decode unmerged'] / serving['decode merged (served)']:.2f}x")
    published = publish_costs(base, root / "published", args.rank, args.rounds)
    for kind, m in published.items():
        print(f"{kind:8s} version {m['bytes']:>13,} B  publish {m['publish']:.3f} s  load {m['load']:.3f} s  "
              f"total {m['publish'] + m['load']:.3f} s  (median of {args.rounds})")  # fmt: skip
    full, adapter = published["full"], published["adapter"]
    print(f"full / adapter: bytes {full['bytes'] / adapter['bytes']:.1f}x, total "
          f"{(full['publish'] + full['load']) / (adapter['publish'] + adapter['load']):.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
