"""The `legorl` command. Each subcommand lives in its own module and is imported
only when run, so `legorl --help` stays fast and never imports JAX."""

from __future__ import annotations

import argparse
import importlib
import signal
import sys

from legorl_jax import commands

# name -> (module, one-line help). A module exposes `add_arguments(parser)` and
# `run(args) -> int`. Only subcommands that work are listed here.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "train": ("legorl_jax.commands.train_cmd", "GRPO training inside real harnesses (default: the embedded demo)"),
    "eval": ("legorl_jax.commands.eval_cmd", "pass rates of a model on tasks, per harness configuration"),
    "collect": (
        "legorl_jax.commands.collect_cmd",
        "a teacher's episodes on tasks and harness configurations, filtered, as a rollouts directory",
    ),
    "sft": (
        "legorl_jax.commands.sft_cmd",
        "supervised fine-tuning on rollouts directories: the sampled tokens' NLL, an HF model at the end",
    ),
    "plot": ("legorl_jax.commands.plot_cmd", "redraw a run's reward plot and per-harness table from its metrics.jsonl"),
    "view": ("legorl_jax.commands.view_cmd", "browse a run in a local web app: curves, rollouts, trajectories, live"),
    "config": ("legorl_jax.commands.config_cmd", "show the resolved run config or its JSON schema"),
    "serve": ("legorl_jax.commands.serve_cmd", "run the embedded JAX inference engine (vLLM-compatible HTTP)"),
    "proxy": ("legorl_jax.commands.proxy_cmd", "run the token-capture proxy in front of an engine, with an admin API"),
    "rollout-server": (
        "legorl_jax.commands.rollout_server_cmd",
        "run a rollout host: engine, proxy, sandboxes, gRPC service",
    ),
    "convert": (
        "legorl_jax.commands.convert_cmd",
        "convert a model between HF checkpoint directories, Orbax and PEFT LoRA adapters",
    ),
    "plan": (
        "legorl_jax.commands.plan_cmd",
        "compile a run's learner for a TPU slice here: memory per chip, step time",
    ),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="legorl",
        description="RL for LLM coding agents inside real harnesses (learner, engine, rollout fleet).",
    )
    from legorl_jax.core.version import __version__

    parser.add_argument("--version", action="version", version=f"legorl-jax {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        importlib.import_module(module).add_arguments(p)
        p.set_defaults(_module=module)
    return parser


def main(argv: list[str] | None = None) -> int:
    from legorl_jax.core.allocator import keep_freed_memory

    # First, before any library starts a thread (see the module for why).
    keep_freed_memory()
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # not where it is ignored (a background job)
        signal.signal(signal.SIGINT, commands.on_sigint)
        sys.unraisablehook = commands.unraisable_hook
    name = "legorl"
    try:
        args = build_parser().parse_args(argv)
        name = f"legorl {args.command}"
        from legorl_jax.core.config import ConfigError
        from legorl_jax.core.errors import InputError, disk_full

        try:
            return int(importlib.import_module(args._module).run(args) or 0)
        except ConfigError as exc:
            print(f"{name}: {exc}", file=sys.stderr)
            return 2
        except InputError as exc:
            print(f"{name}: {exc}", file=sys.stderr)
            return 1
        except Exception as exc:
            if (why := disk_full(exc)) is None:
                raise
            # Every writer leaves the last complete version in place (checkpoints, published weights,
            # logs): the run is whole up to there, and the user's move is to free space.
            print(
                f"{name}: the disk is full ({why}); free space and run the command again "
                "(`legorl train` resumes from its last checkpoint)",
                file=sys.stderr,
            )
            return 1
    except KeyboardInterrupt:
        print(f"{name}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        if not commands.interrupted:
            raise
        # What Ctrl-C broke on its way (an import cut short) is no error of the command's.
        print(f"{name}: interrupted ({type(exc).__name__}: {exc})", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
