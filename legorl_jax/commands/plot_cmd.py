"""`legorl plot RUN_DIR`: redraws a run's plot and its per-harness table from its metrics.jsonl."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a run directory (holds metrics.jsonl)")
    parser.add_argument("--out", default=None, help="output PNG (default: RUN_DIR/reward.png)")


def run(args: argparse.Namespace) -> int:
    from legorl_jax.train.harness_table import write_harness_table
    from legorl_jax.train.plot import plot_run

    try:
        path = plot_run(args.run_dir, args.out)
    except FileNotFoundError as exc:
        print(f"legorl plot: {exc}")
        return 1
    print(path)
    table = write_harness_table(args.run_dir)
    if table is not None:
        print(table)
    return 0
