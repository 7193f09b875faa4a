#!/usr/bin/env python3
"""Training-loop benchmark: where a step's wall time goes, synchronous vs overlapped.

Part 1 runs the real `Trainer` twice in this process on a shortened embedded
config (configs/demo.yaml plus overrides: a tiny random Qwen3, a coin-flip
task whose verifier grades at random so every step has reward contrast, the
local sandbox), once with `rl.max_policy_lag=0` and once with 1, and splits
each run's steady-state wall time into rollouts, learner steps, weight
publishing and reload. The first `--warmup` steps (XLA compilation, the
step-0 evaluation) are left out. Rollout and learner times come from
the step records in metrics.jsonl (`time/rollout_s`, `time/learner_s`,
`time/publish_s`, `time/reload_s`); step boundaries, and so the wall time,
come from a `StepClock` around the fleet (every step ends with a weight
update). With lag 1, rollouts run
while the learner trains, so the phases sum to more than the wall time; that
excess, as a share of the shorter of the two (on a GPU fleet: the learner),
is what the overlap hid.

Part 2 publishes a larger random model with `DirectoryPublisher` and has a
rollout server load it (`Fleet.update_weights`: gRPC, engine pause, reload,
resume), timed against a raw copy (read + write) of the same safetensors
bytes right after each publish (so the copy reads them from the page cache);
the median ratio over the pairs is reported.

    .venv/bin/python scripts/bench_train.py [--steps 5] [--warmup 1] [--io-hidden 512]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from legorl_jax.core.config import Config, load_config
from legorl_jax.fleet import Fleet, FleetError
from legorl_jax.train.loop import Trainer
from legorl_jax.train.run_log import read_metrics
from legorl_jax.wiring import run_inputs

# A task whose verifier flips a coin: an untrained model gets reward contrast,
# so no step is skipped for lack of informative groups.
COINFLIP_TASK = {
    "task.toml": '[task]\nname = "bench-coinflip"\n\n[verifier]\ntimeout_sec = 30.0\n\n'
    "[agent]\ntimeout_sec = 60.0\n\n[environment]\ncpus = 1\nmemory_mb = 256\n",
    "instruction.md": "Say anything, then stop.\n",
    "environment/Dockerfile": "FROM legorl/base:bookworm\nWORKDIR /app\n",
    "tests/test.sh": "#!/bin/bash\nmkdir -p /logs/verifier\necho $((RANDOM % 2)) > /logs/verifier/reward.txt\n",
}


def write_task(root: Path) -> Path:
    for name, text in COINFLIP_TASK.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    (root / "tests" / "test.sh").chmod(0o755)
    return root


def bench_config(args: argparse.Namespace, model_dir: Path, task_dir: Path, run_dir: Path, lag: int) -> Config:
    overrides = {
        "model.path": str(model_dir),
        "tasks.demo": False,
        "tasks.train": [str(task_dir)],
        "tasks.eval_every": 10_000,  # evaluation only at step 0 and the end, both outside the window
        "total_steps": args.warmup + args.steps,
        "rl.max_policy_lag": lag,
        "rl.group_size": args.group_size,
        "rl.groups_per_step": args.groups,
        "rl.sampling.max_tokens": args.max_tokens,
        "sandbox.kind": args.sandbox,
        "logging.run_dir": str(run_dir),
        "logging.run_name": f"lag{lag}",
        "logging.tensorboard": False,
        "learner.checkpoint.every_steps": 10_000,  # one forced save after the last step
        "learner.length_buckets": [1024, 2048],
        # Rows are padded to a full micro-batch; the demo's 8,192 would mostly train padding here.
        "learner.micro_batch_tokens": args.micro_batch_tokens,
        "harness_mix.harnesses": [{"name": "lego", "options": {"tools": "bash_only", "turn_budget": "short"}}],
    }
    # JSON is YAML, so lists and mappings survive `--set` parsing intact.
    return load_config(None, [f"{key}={json.dumps(value)}" for key, value in overrides.items()])


class StepClock:
    """Benchmark instrument: a `Fleet` that notes when each `update_weights`
    returns. Every step ends by loading its weights on the fleet, so these are
    the step boundaries: ends[0] is the load before any rollout, ends[k] step k's."""

    def __init__(self, fleet: Fleet) -> None:
        self._fleet = fleet
        self.ends: list[float] = []  # time.monotonic()

    async def update_weights(self, version: int, location: str) -> dict[str, int]:
        loaded = await self._fleet.update_weights(version, location)
        self.ends.append(time.monotonic())
        return loaded

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fleet, name)


class BenchTrainer(Trainer):
    def __init__(self, config: Config) -> None:
        super().__init__(config, run_inputs(config, progress=False), progress=False)
        self.clock: StepClock | None = None

    @contextlib.asynccontextmanager
    async def fleet_session(self, first_weights: Path) -> AsyncIterator[Fleet]:
        async with super().fleet_session(first_weights) as fleet:
            self.clock = StepClock(fleet)
            yield self.clock  # type: ignore[misc]  # duck-typed Fleet


class Unmeasurable(RuntimeError):
    """The run cannot be split: it ended early, or its step records lack a phase time."""


# Split field -> the step record's key for it.
TIMES = {
    "rollout": "time/rollout_s", "learner": "time/learner_s", "publish": "time/publish_s", "reload": "time/reload_s",
}  # fmt: skip
PHASES = (*TIMES, "other")
LABELS = {"other": "other (< 0: overlap)"}


@dataclasses.dataclass(frozen=True)
class Split:
    """Per-step means over the measured window, in seconds."""

    steps: int
    skipped_updates: int
    wall: float
    rollout: float
    learner: float
    publish: float
    reload: float

    @property
    def other(self) -> float:
        return self.wall - self.rollout - self.learner - self.publish - self.reload

    @property
    def hidden(self) -> float:
        """Share of the shorter of rollouts and learner that ran concurrently with
        the other: the phases' excess over the wall time. Bookkeeping in `other`
        makes it an underestimate."""
        shorter = min(self.rollout, self.learner)
        return min(max(-self.other / shorter, 0.0), 1.0) if shorter > 0 else 0.0


def split_run(records: list[dict[str, Any]], ends: list[float], warmup: int) -> Split:
    """Per-step means over the steps after `warmup`; `ends` as `StepClock.ends`."""
    train = sorted((r for r in records if r.get("kind") == "train"), key=lambda r: r["step"])
    window = [r for r in train if r["step"] > warmup]
    if not window or len(ends) <= window[-1]["step"]:
        raise Unmeasurable(f"run too short to measure: {len(train)} steps, {len(ends)} weight updates")
    missing = {key for key in TIMES.values() if any(key not in r for r in window)}
    if missing:
        raise Unmeasurable(f"step records lack {sorted(missing)}; this loop does not time every phase")
    n = len(window)
    first, last = window[0]["step"], window[-1]["step"]

    def mean(key: str) -> float:
        return sum(r[key] for r in window) / n

    return Split(
        steps=n,
        skipped_updates=sum(1 for r in window if r.get("skipped_update")),
        wall=(ends[last] - ends[first - 1]) / n,
        **{phase: mean(key) for phase, key in TIMES.items()},
    )


async def train_split(config: Config, warmup: int, timeout_s: float) -> Split:
    trainer = BenchTrainer(config)
    try:
        run_dir = await asyncio.wait_for(trainer.run(), timeout_s)
    except TimeoutError:
        raise Unmeasurable(f"no result within {timeout_s:.0f} s: the loop stalled") from None
    assert trainer.clock is not None
    return split_run(read_metrics(run_dir), trainer.clock.ends, warmup)


async def publish_reload_vs_copy(config: Config, model_dir: Path, scratch: Path, repeat: int) -> dict[str, float]:
    """Median over `repeat` pairs of (publish + reload) and a raw copy of the published bytes."""
    from legorl_jax.models import from_hf
    from legorl_jax.train.publish import DirectoryPublisher, publish_weights
    from rollout_server.server import RolloutServer

    model = await asyncio.to_thread(from_hf, model_dir, dtype=config.model.param_dtype)
    publisher = DirectoryPublisher(scratch / "weights", keep=2, tokenizer_from=model_dir)
    server = RolloutServer(config, model_dir, address="127.0.0.1:0")
    address = await server.start()
    publish_s, reload_s, copy_s, nbytes = [], [], [], 0
    try:
        async with Fleet([address]) as fleet:
            for version in range(1, repeat + 1):
                report = await publish_weights(publisher, fleet, model, version)  # the loop's own path
                publish_s.append(report.publish_s)
                reload_s.append(report.load_s)
                files = sorted(Path(report.location).glob("*.safetensors"))
                nbytes = sum(f.stat().st_size for f in files)
                copy_s.append(await asyncio.to_thread(raw_copy, files, scratch / "raw"))
    finally:
        await server.stop(grace_s=5)
    ratios = [(p + r) / c for p, r, c in zip(publish_s, reload_s, copy_s, strict=True)]
    return {
        "bytes": float(nbytes),
        "publish_s": statistics.median(publish_s),
        "reload_s": statistics.median(reload_s),
        "copy_s": statistics.median(copy_s),
        "ratio": statistics.median(ratios),
    }


def raw_copy(files: list[Path], dest: Path) -> float:
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    started = time.monotonic()
    for f in files:
        shutil.copyfile(f, dest / f.name)
    return time.monotonic() - started


def split_table(splits: dict[int, Split]) -> str:
    """A markdown table: one column per lag, seconds per step and share of the wall time."""

    def seconds(value: float, wall: float) -> str:
        return f"{value:.2f} s ({100 * value / wall:.0f}%)"

    def hidden(s: Split) -> str:
        return f"{100 * s.hidden:.0f}% of {'rollouts' if s.rollout < s.learner else 'learner'}"

    def phase(name: str) -> Callable[[Split], str]:
        return lambda s: seconds(getattr(s, name), s.wall)

    rows: list[tuple[str, Callable[[Split], str]]] = [("wall", lambda s: f"{s.wall:.2f} s")]
    rows += [(LABELS.get(name, name), phase(name)) for name in PHASES]
    rows += [("hidden by overlap", hidden), ("steps (skipped)", lambda s: f"{s.steps} ({s.skipped_updates})")]
    lines = ["| per step | " + " | ".join(f"lag {lag}" for lag in splits) + " |", "| --- |" + " --- |" * len(splits)]
    lines += [f"| {label} | " + " | ".join(fmt(s) for s in splits.values()) + " |" for label, fmt in rows]
    return "\n".join(lines)


async def bench(args: argparse.Namespace, scratch: Path) -> None:
    from legorl_jax.models.demo_assets import build_tiny_hf_model

    model_dir = build_tiny_hf_model(
        scratch / "model", hidden_size=args.hidden, num_layers=args.layers, intermediate_size=3 * args.hidden
    )
    task_dir = write_task(scratch / "task")
    splits, failures = {}, {}
    for lag in (0, 1):
        config = bench_config(args, model_dir, task_dir, scratch / "runs", lag)
        try:
            splits[lag] = await train_split(config, args.warmup, args.run_timeout)
        except (FleetError, Unmeasurable) as exc:  # the other lag still gets measured
            failures[lag] = f"{type(exc).__name__}: {exc}"
    print(f"\nTraining loop, steady state over {args.steps} steps after {args.warmup} warm-up "
          f"(model hidden {args.hidden} x {args.layers} layers, {args.groups} groups x {args.group_size}, "
          f"{args.max_tokens} tokens per call):")  # fmt: skip
    if splits:
        print(split_table(splits))
    for lag, why in failures.items():
        print(f"lag {lag}: run failed, not measured: {why}")
    if len(splits) == 2:
        print(f"lag-1 speed-up (lag-0 step wall / lag-1 step wall): {splits[0].wall / splits[1].wall:.2f}x")

    io_model = build_tiny_hf_model(
        scratch / "io-model", hidden_size=args.io_hidden, num_layers=args.io_layers,
        intermediate_size=3 * args.io_hidden, vocab_size=args.io_vocab,
        num_heads=args.io_hidden // 64, num_kv_heads=max(1, args.io_hidden // 256), head_dim=64,
    )  # fmt: skip
    io_config = bench_config(args, io_model, task_dir, scratch / "runs", 0)
    io = await publish_reload_vs_copy(io_config, io_model, scratch, args.repeat)
    gb = io["bytes"] / 1e9
    print(f"\nWeight publish + reload, {gb:.3f} GB of safetensors, median of {args.repeat}:")
    print(f"  publish {io['publish_s']:.3f}s  reload {io['reload_s']:.3f}s  raw copy {io['copy_s']:.3f}s "
          f"({gb / io['copy_s']:.2f} GB/s)  (publish + reload) / raw copy = {io['ratio']:.1f}x")  # fmt: skip


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=positive, default=4, help="measured steps per run")
    parser.add_argument("--warmup", type=non_negative, default=1, help="leading steps left out (compilation)")
    parser.add_argument("--group-size", type=positive, default=2)
    parser.add_argument("--groups", type=positive, default=2, help="groups per step")
    parser.add_argument("--max-tokens", type=positive, default=16, help="completion tokens per model call")
    parser.add_argument("--micro-batch-tokens", type=positive, default=2048, help="learner micro-batch budget")
    parser.add_argument("--hidden", type=positive, default=64, help="hidden size of the trained model")
    parser.add_argument("--layers", type=positive, default=2)
    parser.add_argument("--run-timeout", type=positive, default=900, help="seconds one training run may take")
    parser.add_argument("--sandbox", choices=["local", "docker", "auto"], default="local")
    parser.add_argument("--io-hidden", type=positive, default=512, help="hidden size of the publish/reload model")
    parser.add_argument("--io-layers", type=positive, default=4)
    parser.add_argument("--io-vocab", type=positive, default=32768)
    parser.add_argument("--repeat", type=positive, default=3, help="publish/reload vs copy pairs")
    parser.add_argument("--dir", type=Path, default=None, help="scratch directory (default: a temp dir)")
    args = parser.parse_args()
    if args.io_hidden % 64:
        parser.error("--io-hidden must be a multiple of 64 (heads of 64)")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    with tempfile.TemporaryDirectory(prefix="bench-train-", dir=args.dir) as scratch:
        asyncio.run(bench(args, Path(scratch)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
