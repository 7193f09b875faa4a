"""One module per `legorl` subcommand (see legorl_jax.cli.SUBCOMMANDS)."""

from __future__ import annotations

import argparse
import sys
from types import FrameType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from legorl_jax.core.config import Config
    from legorl_jax.train.groups import HarnessChoice

# Whether Ctrl-C came while `legorl` handled SIGINT as Python does (`on_sigint`). Here, not in
# legorl_jax.cli, which is `__main__` under `python -m legorl_jax.cli`, a second copy to the commands.
interrupted = False


def on_sigint(signum: int, frame: FrameType | None) -> None:
    """Python's own Ctrl-C handling, remembered: the KeyboardInterrupt may land in an import
    whose extension turns it into another error (jaxlib's ImportError), or where it is dropped
    (a garbage-collection callback, a library's catch-all)."""
    global interrupted
    interrupted = True
    raise KeyboardInterrupt


def unraisable_hook(unraisable: sys.UnraisableHookArgs) -> None:
    """Python's report of an exception it cannot raise, except for a Ctrl-C `on_sigint` took
    that landed in such a place (a garbage-collection callback): not lost, only late (`raise_if_interrupted`)."""
    if not (interrupted and unraisable.exc_type is not None and issubclass(unraisable.exc_type, KeyboardInterrupt)):
        sys.__unraisablehook__(unraisable)


def raise_if_interrupted() -> None:
    """Raises KeyboardInterrupt if Ctrl-C came and was dropped on the way: a command calls it
    before it takes over SIGINT itself (`legorl train` before its loop starts)."""
    if interrupted:
        raise KeyboardInterrupt


def add_config_arguments(parser: argparse.ArgumentParser, demo_default: bool) -> None:
    """The --config / --set pair every config-driven subcommand takes. `demo_default`:
    without --config the command runs the demo (train, eval); else it starts from the
    schema's own defaults, sized for real harness sessions (the standalone services)."""
    default = "configs/demo.yaml" if demo_default else "the schema's own defaults, sized for real harness sessions"
    parser.add_argument("--config", metavar="FILE", help=f"YAML run config (default: {default})")
    parser.add_argument(
        "--set",
        dest="overrides",
        metavar="PATH=VALUE",
        action="append",
        default=[],
        help="override one field, e.g. --set rl.sampling.temperature=0.7 (repeatable; value parsed as YAML)",
    )
    parser.set_defaults(demo_default=demo_default)


def load_command_config(args: argparse.Namespace, overrides: list[str] | None = None) -> Config:
    """The config a subcommand runs with: --config, else its default (add_config_arguments)."""
    from legorl_jax.core.config import DEFAULT_CONFIG, load_config

    default = DEFAULT_CONFIG if args.demo_default else None
    return load_config(args.config, args.overrides if overrides is None else overrides, default=default)


def add_trial_arguments(parser: argparse.ArgumentParser, tasks_default: str) -> None:
    """--tasks / --harness / --samples: which trials a command runs (eval, collect)."""
    parser.add_argument(
        "--tasks",
        nargs="+",
        default=None,
        metavar="PATH",
        help=f"task roots or JSONL indexes (default: {tasks_default})",
    )
    parser.add_argument(
        "--harness",
        action="append",
        default=None,
        metavar="JSON",
        help='harness config as JSON, e.g. \'{"name": "lego", "options": {"tools": "bash_only"}}\' '
        "(repeatable; default: the config's harness_mix)",
    )
    parser.add_argument("--samples", type=int, default=1, help="trials per task and harness config")


def trial_choices(args: argparse.Namespace, config: Config) -> list[HarnessChoice]:
    """The harness configurations `add_trial_arguments` asked for, after checking --harness and --samples."""
    import json

    from legorl_jax.core.config import ConfigError, HarnessSpec
    from legorl_jax.train.groups import harness_choice

    try:
        specs = [HarnessSpec.model_validate(json.loads(h)) for h in args.harness] if args.harness else None
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"--harness: {exc}") from None
    if args.samples < 1:
        raise ConfigError("--samples must be at least 1")
    return [harness_choice(h) for h in (specs or config.harness_mix.harnesses)]
