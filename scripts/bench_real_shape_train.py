#!/usr/bin/env python
"""Benchmark: `legorl train` for two steps at a real model's shape against the toy's.

Runs the exact command of tests/loop/test_real_shape_e2e.py (a random-weight
smollm2-135m-shaped model with a 49,152-token tokenizer, the real proxy, the
embedded engine in its own process, Docker sandboxes, the coinflip task) and,
as the baseline, the same command on the tests' tiny random model, one after
the other in this process. Per run: wall seconds, the summed resident memory of
the trainer's process tree at its peak (trainer + engine; sampled every 0.5 s)
and each process's own peak, the rollout and learner seconds of each step
(from metrics.jsonl); then real/toy ratios.

    .venv/bin/python scripts/bench_real_shape_train.py [--work-dir DIR] [--only toy|real]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
# The test module is the one place the run is defined (model, tokenizer, settings, command).
REAL_SHAPE_TEST = importlib.import_module("loop.test_real_shape_e2e")


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            parent = int(stat[stat.rindex(")") + 2 :].split()[1])
            kids.setdefault(parent, []).append(int(entry))
    return kids


def _rss(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _role(pid: int) -> str:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return "other"
    for role in (b"train", b"serve"):
        if role in argv:
            return role.decode()
    return "other"


def measured_run(command: list[str], run_dir: Path) -> dict[str, Any]:
    """Runs `command` to the end, sampling its process tree's resident memory."""
    start = time.perf_counter()
    with (run_dir / "log.txt").open("w") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        peak_total, peak_by_role = 0, {"train": 0, "serve": 0}
        while proc.poll() is None:
            kids, tree, todo = _children(), [], [proc.pid]
            while todo:
                pid = todo.pop()
                tree.append(pid)
                todo += kids.get(pid, [])
            sizes = {pid: _rss(pid) for pid in tree}
            peak_total = max(peak_total, sum(sizes.values()))
            for pid, size in sizes.items():
                role = _role(pid)
                if role in peak_by_role:
                    peak_by_role[role] = max(peak_by_role[role], size)
            time.sleep(0.5)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"run failed ({proc.returncode}); see {run_dir / 'log.txt'}")
    records = [json.loads(line) for line in (run_dir / "e2e" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r.get("kind") == "train"]
    return {
        "wall_s": round(wall, 1),
        "peak_tree_rss_gb": round(peak_total / 2**30, 2),
        "peak_trainer_rss_gb": round(peak_by_role["train"] / 2**30, 2),
        "peak_engine_rss_gb": round(peak_by_role["serve"] / 2**30, 2),
        "rollout_s": [round(r["time/rollout_s"], 1) for r in steps],
        "learner_s": [round(r["time/learner_s"], 1) for r in steps],
        "trained_sequences": [r.get("sequences/trained", 0) for r in steps],
    }


def main() -> None:
    from legorl_jax.models.demo_assets import build_tiny_hf_model

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work-dir", type=Path, help="keep models, runs and logs here (default: a temp dir)")
    parser.add_argument("--only", choices=("toy", "real"), default=None, help="run one side only")
    args = parser.parse_args()
    load_before = os.getloadavg()
    with contextlib.ExitStack() as stack:
        root = args.work_dir or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-real-shape-")))
        builders: dict[str, Callable[[Path], Path]] = {
            "toy": build_tiny_hf_model,
            "real": REAL_SHAPE_TEST.build_real_shape_model,
        }
        models = {name: build(root / name) for name, build in builders.items() if args.only in (None, name)}
        rows = {}
        for name, model in models.items():
            run_dir = root / f"run-{name}"
            run_dir.mkdir(parents=True)
            rows[name] = measured_run(REAL_SHAPE_TEST.real_shape_command(model, run_dir), run_dir)
            print(json.dumps({"model": name, **rows[name]}), flush=True)
    if args.only is not None:
        return
    real, toy = rows["real"], rows["toy"]
    print(
        json.dumps(
            {
                "wall_ratio": round(real["wall_s"] / toy["wall_s"], 2),
                "peak_tree_rss_ratio": round(real["peak_tree_rss_gb"] / toy["peak_tree_rss_gb"], 2),
                "load_avg_before": [round(x, 2) for x in load_before],
                "load_avg_after": [round(x, 2) for x in os.getloadavg()],
                "cpus": os.cpu_count(),
            }
        )
    )


if __name__ == "__main__":
    main()
