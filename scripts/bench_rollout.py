#!/usr/bin/env python3
"""Per-trial overhead outside the agent, and trial throughput, through the real
rollout server over gRPC.

Starts a `RolloutServer` in this process (embedded JAX engine serving a tiny
random model, Docker sandboxes, the demo tasks) and sends it `Rollout` calls of
one `lego` trial each, at most C calls in flight, for every C in --concurrency.
Times come from each trajectory's own phase times, measured by the server:

  overhead  = setup (image cache check, container create/start)
            + verify (kill the agent's processes, copy the tests in, run them,
              read the reward; the lego harness copies nothing in: it gets the
              instruction in its prompt)
            + teardown (container removal)
  trial     = overhead + agent (the lego loop: model calls through the proxy,
              tool calls executed in the container)

Prints, per concurrency level, median and p95 of overhead and trial time, the
overhead fraction (overhead / trial, per trial) and trials per minute, plus
throughput against the first level, all from this one run. Only graded trials
(ok, timeout, cap_exceeded) enter the timings; the others are counted.

The model is random and its turns are capped (--max-tokens, --max-model-calls),
so the agent phase is short: the overhead fraction here is near a worst case.
Before each level, an untimed warm-up round of C trials at that concurrency
runs, so the engine's compilations for that batch size (and the task image's
build or cache hit) fall outside the measured round.

    .venv/bin/python scripts/bench_rollout.py --concurrency 1 8 32 --trials 8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import grpc  # noqa: E402

from legorl_jax.core.config import Config, ConfigError, load_config  # noqa: E402
from protos.legorl.v1 import rollout_pb2 as pb  # noqa: E402
from protos.legorl.v1 import rollout_pb2_grpc as pb_grpc  # noqa: E402
from rollout_server.server import RolloutServer  # noqa: E402

GRADED = {pb.TRIAL_STATUS_OK, pb.TRIAL_STATUS_TIMEOUT, pb.TRIAL_STATUS_CAP_EXCEEDED}
PHASES = ("setup_s", "agent_s", "verify_s", "teardown_s")


def overhead_s(t: pb.Trajectory) -> float:
    p = t.metrics.phase_times
    return p.setup_s + p.verify_s + p.teardown_s


def trial_s(t: pb.Trajectory) -> float:
    return overhead_s(t) + t.metrics.phase_times.agent_s


def median_p95(values: list[float]) -> tuple[float, float]:
    return float(np.median(values)), float(np.percentile(values, 95))


def server_config(args: argparse.Namespace) -> Config:
    peak = max(args.concurrency)
    overrides = [
        "engine.port=0",
        f"engine.max_batch={peak}",
        "sandbox.kind=docker",
        f"fleet.capacity_per_server={peak}",
        "fleet.agent_timeout_s=300",
        f"proxy.max_model_calls={args.max_model_calls}",
        "tasks.demo=true",
    ]
    return load_config(args.config, overrides)


def request(args: argparse.Namespace, index: int) -> pb.RolloutRequest:
    options = {"tools": "bash_only", "turn_budget": "short"}
    return pb.RolloutRequest(
        request_id=f"bench-{index}",
        tasks=[pb.TaskRef(task_id=args.task)],
        harness_configs=[pb.HarnessConfig(name="lego", options_json=json.dumps(options), config_id="bench")],
        group_size=1,
        sampling=pb.SamplingParams(temperature=1.0, top_p=1.0, top_k=-1, max_tokens=args.max_tokens, seed=index),
    )


async def run_level(
    stub: pb_grpc.RolloutServiceStub, args: argparse.Namespace, level: int, n: int
) -> tuple[list[pb.Trajectory], float]:
    gate = asyncio.Semaphore(level)

    async def one(index: int) -> list[pb.Trajectory]:
        async with gate:
            return [t async for t in stub.Rollout(request(args, index))]

    began = time.perf_counter()
    batches = await asyncio.gather(*(one(i) for i in range(n)))
    return [t for batch in batches for t in batch], time.perf_counter() - began


def report(level: int, trajectories: list[pb.Trajectory], elapsed: float) -> dict[str, float]:
    statuses = Counter(pb.TrialStatus.Name(t.status).removeprefix("TRIAL_STATUS_").lower() for t in trajectories)
    graded = [t for t in trajectories if t.status in GRADED]
    row = {"level": level, "n": len(trajectories), "per_min": len(trajectories) / elapsed * 60}
    calls = np.median([t.metrics.model_calls for t in trajectories])
    print(
        f"\nconcurrency {level}: {len(trajectories)} trials in {elapsed:.1f}s -> {row['per_min']:.1f} trials/min;"
        f" statuses {dict(statuses)}; model calls per trial, median {calls:.0f}"
    )
    if not graded:
        print("  no graded trial: no timings")
        return row
    print(f"  {'phase':<22} {'median s':>9} {'p95 s':>9}")
    for phase in PHASES:
        med, p95 = median_p95([getattr(t.metrics.phase_times, phase) for t in graded])
        print(f"  {phase:<22} {med:9.3f} {p95:9.3f}")
    row["overhead_med"], row["overhead_p95"] = median_p95([overhead_s(t) for t in graded])
    row["trial_med"], row["trial_p95"] = median_p95([trial_s(t) for t in graded])
    row["fraction_med"], row["fraction_p95"] = median_p95([overhead_s(t) / trial_s(t) for t in graded])
    print(f"  {'overhead (not agent)':<22} {row['overhead_med']:9.3f} {row['overhead_p95']:9.3f}")
    print(f"  {'trial':<22} {row['trial_med']:9.3f} {row['trial_p95']:9.3f}")
    print(f"  {'overhead / trial':<22} {row['fraction_med']:9.3f} {row['fraction_p95']:9.3f}")
    return row


def print_table(rows: list[dict[str, float]]) -> None:
    base = rows[0]["per_min"]
    print(
        "\n| concurrency | trials | trials/min | vs first level | overhead med / p95 s | trial med / p95 s "
        "| overhead/trial med / p95 |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        timing = (
            f"{r['overhead_med']:.2f} / {r['overhead_p95']:.2f} | {r['trial_med']:.2f} / {r['trial_p95']:.2f} "
            f"| {r['fraction_med']:.2f} / {r['fraction_p95']:.2f}"
            if "overhead_med" in r
            else "- | - | -"
        )
        print(f"| {r['level']} | {r['n']} | {r['per_min']:.1f} | {r['per_min'] / base:.2f}x | {timing} |")


async def bench(args: argparse.Namespace, model_dir: Path) -> None:
    began = time.perf_counter()
    server = RolloutServer(server_config(args), model_dir)
    address = await server.start()
    print(f"rollout server up in {time.perf_counter() - began:.1f}s on {address}")
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = pb_grpc.RolloutServiceStub(channel)
            rows = []
            for level in args.concurrency:
                warm, elapsed = await run_level(stub, args, level, level)
                errors = Counter(t.error for t in warm if t.status not in GRADED)
                print(f"\nwarm-up round at concurrency {level}: {elapsed:.1f}s; ungraded: {dict(errors) or 'none'}")
                trajectories, elapsed = await run_level(stub, args, level, max(args.trials, level))
                rows.append(report(level, trajectories, elapsed))
        print_table(rows)
    finally:
        await server.stop(grace_s=60)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32], help="Trials in flight per level.")
    parser.add_argument("--trials", type=int, default=8, help="Trials per level (at least the level itself).")
    parser.add_argument("--task", default="edit-config", help="Demo task every trial runs (default: %(default)s).")
    parser.add_argument("--model", metavar="DIR", help="HF model the engine serves (default: a tiny random Qwen3).")
    parser.add_argument("--max-tokens", type=int, default=32, help="Completion tokens per model call.")
    parser.add_argument("--max-model-calls", type=int, default=3, help="Model calls per trial (proxy cap).")
    parser.add_argument("--config", metavar="FILE", help="Base run config (default: configs/demo.yaml).")
    args = parser.parse_args()
    if min(args.concurrency) < 1 or args.trials < 1 or args.max_tokens < 1 or args.max_model_calls < 1:
        parser.error("--concurrency, --trials, --max-tokens and --max-model-calls must be positive")
    with tempfile.TemporaryDirectory(prefix="bench-rollout-") as tmp:
        model_dir = Path(args.model) if args.model else None
        if model_dir is None:
            from legorl_jax.models.demo_assets import build_tiny_hf_model

            model_dir = build_tiny_hf_model(Path(tmp) / "tiny")
        try:
            asyncio.run(bench(args, model_dir))
        except ConfigError as exc:
            print(f"bench_rollout: {exc}", file=sys.stderr)
            return 2
        except grpc.aio.AioRpcError as exc:
            print(f"bench_rollout: the rollout server refused: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
