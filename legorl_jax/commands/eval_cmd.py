"""`legorl eval`: pass rates of a model on tasks, per harness configuration."""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

from legorl_jax.commands import add_config_arguments, add_trial_arguments, load_command_config, trial_choices


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, metavar="DIR", help="HF model directory to evaluate")
    add_trial_arguments(parser, "the config's tasks.eval plus, with tasks.demo, the held-out demo variants")
    add_config_arguments(parser, demo_default=True)


def run(args: argparse.Namespace) -> int:
    from legorl_jax.commands.train_cmd import join_process_group
    from legorl_jax.core.config import ConfigError
    from legorl_jax.fleet import configured_fleet
    from legorl_jax.train.coordination import ProcessGroup
    from legorl_jax.train.evaluate import evaluate
    from legorl_jax.wiring import local_server, task_ids

    overrides = [*args.overrides, f"model.path={args.model}"]
    if args.tasks:  # the in-process rollout server serves the config's tasks: make it these
        overrides += [f"tasks.eval={json.dumps(args.tasks)}", "tasks.train=[]", "tasks.demo=false"]
    config = load_command_config(args, overrides)
    choices = trial_choices(args, config)
    ids = task_ids(config, "eval")
    if not ids:
        raise ConfigError("no evaluation tasks: pass --tasks, or set tasks.eval or tasks.demo in the config")
    join_process_group(config.learner.heartbeat_timeout_s)

    async def main() -> dict[str, float]:
        async with configured_fleet(config.fleet, local_server(config), Path(args.model)) as fleet:
            return await evaluate(fleet, config, ids * args.samples, choices, policy_version=0, step=0,
                                  progress=config.logging.progress)  # fmt: skip

    # One evaluation, not one per process: process 0 runs it, the others wait for it to end.
    results = asyncio.run(ProcessGroup().leader_only(main))
    if results is None:
        print("legorl eval: process 0 evaluated; its output has the results", flush=True)
        return 0
    print(json.dumps({"tasks": len(ids), "samples": args.samples, **results}, indent=2))
    return 0
