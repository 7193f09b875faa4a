#!/usr/bin/env python3
"""Per-trial sandbox overhead outside the agent, and trial throughput.

Each trial runs a demo task with a scripted no-op agent (one `true` as the
agent user), so everything measured is overhead: create/start, copy-in of the
instruction, verify (kill, reset, copy tests, test.sh, read reward), teardown.
Prints median and p95 per phase and trials/min at each concurrency, plus the
throughput scaling against concurrency 1 and, with --kind both, the Docker
overhead against the local sandbox's, all measured in this process.

    .venv/bin/python scripts/bench_sandbox.py --kind both --concurrency 1 8 32
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rollout_server.sandbox.base import AGENT_USER, Sandbox, SandboxSpec  # noqa: E402
from rollout_server.sandbox.factory import SandboxFactory, spec_for_task  # noqa: E402
from rollout_server.sandbox.images import ensure_task_image  # noqa: E402
from rollout_server.sandbox.local import LocalSandbox  # noqa: E402
from rollout_server.tasks import Task, demo_tasks  # noqa: E402
from rollout_server.verifier import verify  # noqa: E402

MakeSandbox = Callable[[SandboxSpec], Sandbox]
PHASES = ("start", "copy_in", "agent", "verify", "teardown")


def one_trial(make: MakeSandbox, task: Task, instruction: Path) -> dict[str, float]:
    times: dict[str, float] = {}
    mark = time.perf_counter()

    def lap(phase: str) -> None:
        nonlocal mark
        now = time.perf_counter()
        times[phase] = now - mark
        mark = now

    box: Sandbox = make(spec_for_task(task, f"bench-{uuid.uuid4().hex[:8]}"))
    try:
        box.start()
        lap("start")
        box.copy_in(instruction, "/logs/agent/instruction.md")
        lap("copy_in")
        box.exec("true", timeout=30, user=AGENT_USER)
        lap("agent")
        verdict = verify(box, task)
        lap("verify")
        if verdict.status != "ok" or verdict.reward != 0.0:
            raise RuntimeError(f"benchmark trial was not graded 0: {verdict}")
    finally:
        box.stop()
        lap("teardown")
    return times


def p95(values: list[float]) -> float:
    return statistics.quantiles(values, n=20)[-1] if len(values) >= 2 else values[0]


def run(kind: str, make: MakeSandbox, task: Task, concurrencies: list[int], trials_per_level: int) -> dict[int, float]:
    with tempfile.TemporaryDirectory() as tmp:
        instruction = Path(tmp) / "instruction.md"
        instruction.write_text(task.instruction)
        one_trial(make, task, instruction)  # warm-up: image lookups, first exec
        throughput: dict[int, float] = {}
        for level in concurrencies:
            n = max(trials_per_level, level)
            began = time.perf_counter()
            with ThreadPoolExecutor(max_workers=level) as pool:
                results = list(pool.map(lambda _: one_trial(make, task, instruction), range(n)))
            elapsed = time.perf_counter() - began
            throughput[level] = n / elapsed * 60
            totals = [sum(r.values()) - r["agent"] for r in results]
            print(f"\n[{kind}] concurrency {level}: {n} trials in {elapsed:.1f}s -> {throughput[level]:.1f} trials/min")
            print(f"  {'phase':<10} {'median s':>9} {'p95 s':>9}")
            for phase in PHASES:
                values = [r[phase] for r in results]
                print(f"  {phase:<10} {statistics.median(values):9.3f} {p95(values):9.3f}")
            print(
                f"  {'overhead':<10} {statistics.median(totals):9.3f} {p95(totals):9.3f}   (all phases but the agent)"
            )
        base = throughput[concurrencies[0]]
        for level in concurrencies[1:]:
            print(
                f"[{kind}] throughput at concurrency {level} is "
                f"{throughput[level] / base:.2f}x concurrency {concurrencies[0]}"
            )
        return throughput


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kind", choices=("docker", "local", "both"), default="docker")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--trials", type=int, default=16, help="Trials per concurrency level (at least the level).")
    parser.add_argument("--task", default="edit-config", help="Demo task to run.")
    args = parser.parse_args()
    task = next((t for t in demo_tasks() if t.name == args.task), None)
    if task is None:
        parser.error(f"no demo task {args.task!r}")
    results: dict[str, dict[int, float]] = {}
    if args.kind in ("docker", "both"):
        factory = SandboxFactory(kind="docker", network="none")
        assert factory.client is not None
        began = time.perf_counter()
        ensure_task_image(factory.client, task.environment_dir, None)
        print(f"task image ready in {time.perf_counter() - began:.1f}s (includes a cold base-image build if any)")
        results["docker"] = run("docker", factory.create, task, args.concurrency, args.trials)
        factory.close()
    if args.kind in ("local", "both"):
        results["local"] = run("local", LocalSandbox, task, args.concurrency, args.trials)
    if len(results) == 2:
        for level in args.concurrency:
            print(
                f"docker/local throughput at concurrency {level}: "
                f"{results['docker'][level] / results['local'][level]:.2f}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
