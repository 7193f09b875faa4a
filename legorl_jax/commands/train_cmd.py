"""`legorl train`: GRPO training inside real harnesses (no config = the embedded default)."""

from __future__ import annotations

import argparse
import asyncio
import logging

from legorl_jax.commands import add_config_arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    parser.add_argument("--no-progress", action="store_true", help="no progress bar (logs and the table only)")
    parser.add_argument(
        "--verbose", action="store_true", help="also log the in-process rollout server's events (weight loads, trials)"
    )


def run(args: argparse.Namespace) -> int:
    from legorl_jax.core.config import load_config
    from legorl_jax.wiring import trainer as build_trainer

    config = load_config(args.config, args.overrides)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("legorl_jax").setLevel(logging.INFO)
    if args.verbose:
        logging.getLogger("rollout_server").setLevel(logging.INFO)
    trainer = build_trainer(config, progress=False if args.no_progress else None)
    print(f"legorl train: run directory {trainer.run_dir}", flush=True)
    run_dir = asyncio.run(trainer.run())
    print(f"legorl train: done; metrics in {run_dir / 'metrics.jsonl'}, plot {run_dir / 'reward.png'}", flush=True)
    return 0
