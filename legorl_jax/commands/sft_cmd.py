"""`legorl sft`: supervised fine-tuning of the config's model on rollouts directories."""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from legorl_jax.commands import add_config_arguments, load_command_config
from legorl_jax.core import log_redaction


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--rollouts",
        nargs="+",
        required=True,
        metavar="DIR",
        help="rollouts directories (`legorl collect --out`, or `legorl train` run directories): their episodes' "
        "sampled tokens are the targets, in the model's tokenizer",
    )
    parser.add_argument(
        "--passing-only", action="store_true", help="train only on episodes that passed (only graded ones ever)"
    )
    parser.add_argument(
        "--min-reward", type=float, default=None, help="train only on episodes with at least this reward"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar (the table only)")
    add_config_arguments(parser, demo_default=True)
    parser.epilog = (
        "Trains model.path (or the demo model; LoRA with model.lora) with the learner's settings and the sft: "
        "section (epochs or steps, batch_size, evaluate); writes the run directory logging.run_dir/run_name "
        "(metrics, checkpoints: the same command resumes) and model/ in it, an HF directory for model.path."
    )


def run(args: argparse.Namespace) -> int:
    from legorl_jax.train.collect import Keep
    from legorl_jax.train.loop import run_directory
    from legorl_jax.train.sft import run_sft
    from legorl_jax.wiring import run_inputs

    config = load_command_config(args)
    log_redaction.configure(logging.WARNING)
    logging.getLogger("legorl_jax").setLevel(logging.INFO)
    progress = config.logging.progress and not args.no_progress
    keep = Keep(passing_only=args.passing_only, min_reward=args.min_reward)
    print(f"legorl sft: run directory {run_directory(config)}", flush=True)
    out, data = run_sft(config, run_inputs(config, progress=progress), [Path(d) for d in args.rollouts], keep,
                        progress=progress)  # fmt: skip
    print(json.dumps({"model": str(out), **data.summary()}, indent=2))
    print(f"legorl sft: done; use it with --set model.path={out}", flush=True)
    return 0
