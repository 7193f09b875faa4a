"""One module per `legorl` subcommand (see legorl_jax.cli.SUBCOMMANDS)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from legorl_jax.core.config import Config


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
