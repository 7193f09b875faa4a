"""`legorl collect`: a teacher's episodes on tasks × harness configurations,
filtered, as a rollouts directory (`rollouts.jsonl` + `collect.json`)."""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

from legorl_jax.commands import add_config_arguments, add_trial_arguments, load_command_config, trial_choices
from legorl_jax.core.config import CHAT_ENGINE_KINDS, ConfigError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        required=True,
        metavar="DIR",
        help="HF model directory of the teacher: served by the config's engine, or with --engine-url only "
        "its tokenizer and chat template are read (the episodes' token ids are in this tokenizer; with "
        "--engine-api, the student's, which the teacher's messages are re-rendered with)",
    )
    parser.add_argument("--out", required=True, metavar="DIR", help="new rollouts directory to write")
    parser.add_argument(
        "--engine-url",
        metavar="URL",
        help="an engine already serving the teacher with vLLM's HTTP surface (vLLM, `legorl serve`), "
        "used as is (engine.kind=external), or with --engine-api a server with a chat API",
    )
    parser.add_argument(
        "--engine-api",
        choices=CHAT_ENGINE_KINDS,
        help="--engine-url is a chat teacher, called through its OpenAI Chat Completions (openai_chat) or "
        "Anthropic Messages (anthropic) API; its messages are recorded re-rendered with --model's chat template, "
        "without logprobs (token exact only for a teacher with the same tokenizer)",
    )
    parser.add_argument("--teacher-model", metavar="NAME", help="with --engine-api: the model the API is asked for")
    parser.add_argument(
        "--api-key-env",
        metavar="VAR",
        help="with --engine-api: environment variable holding the API key (never given on the command line)",
    )
    add_trial_arguments(parser, "the config's training tasks, with tasks.demo the demo's")
    parser.add_argument("--passing-only", action="store_true", help="keep only episodes that passed their verifier")
    parser.add_argument("--min-reward", type=float, default=None, help="keep only episodes with at least this reward")
    parser.add_argument(
        "--per-task-cap", type=int, default=None, metavar="N", help="keep at most N episodes per task, best first"
    )
    add_config_arguments(parser, demo_default=True)


def run(args: argparse.Namespace) -> int:
    from legorl_jax.fleet import configured_fleet
    from legorl_jax.train.collect import RERENDERED, Keep, collect, refuse_existing
    from legorl_jax.wiring import local_server, task_ids

    try:
        refuse_existing(Path(args.out))  # before any engine starts
    except FileExistsError as exc:
        raise ConfigError(f"--out: {exc}") from None

    overrides = [*args.overrides, f"model.path={args.model}", *_engine_overrides(args)]
    if args.tasks:  # the in-process rollout server serves the config's tasks: make it these
        overrides += [f"tasks.train={json.dumps(args.tasks)}", "tasks.eval=[]", "tasks.demo=false"]
    config = load_command_config(args, overrides)
    choices = trial_choices(args, config)
    try:
        keep = Keep(args.passing_only, args.min_reward, args.per_task_cap)
    except ValueError as exc:
        raise ConfigError(f"--per-task-cap: {exc}") from None
    ids = task_ids(config, "train")
    if not ids:
        raise ConfigError("no tasks: pass --tasks, or set tasks.train or tasks.demo in the config")
    model = Path(args.model)
    source = {"model": str(model), "engine": config.engine.kind, "url": config.engine.url}
    if config.engine.kind in CHAT_ENGINE_KINDS:
        source.update(teacher_model=config.engine.teacher_model, tokens=RERENDERED)

    async def main() -> dict[str, object]:
        async with configured_fleet(config.fleet, local_server(config), model) as fleet:
            return await collect(
                fleet, config, ids, choices, samples=args.samples, keep=keep, out_dir=Path(args.out),
                tokenizer_dir=model, source=source,
            )  # fmt: skip

    manifest = asyncio.run(main())
    print(json.dumps(manifest, indent=2))
    return 0


def _engine_overrides(args: argparse.Namespace) -> list[str]:
    """The engine section --engine-url and the chat teacher's flags make."""
    teacher = {"--teacher-model": args.teacher_model, "--api-key-env": args.api_key_env}
    if not args.engine_api:
        if given := [flag for flag, value in teacher.items() if value]:
            raise ConfigError(f"{', '.join(given)}: settings of a chat teacher, given with --engine-api")
        return ["engine.kind=external", f"engine.url={args.engine_url}"] if args.engine_url else []
    if not (args.engine_url and args.teacher_model):
        raise ConfigError("--engine-api: give the teacher's server (--engine-url) and model (--teacher-model)")
    overrides = [f"engine.kind={args.engine_api}", f"engine.url={args.engine_url}"]
    overrides.append(f"engine.teacher_model={args.teacher_model}")
    return overrides + ([f"engine.api_key_env={args.api_key_env}"] if args.api_key_env else [])
