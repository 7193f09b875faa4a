"""One module per `legorl` subcommand (see legorl_jax.cli.SUBCOMMANDS)."""

import argparse


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """The --config / --set pair every config-driven subcommand takes."""
    parser.add_argument("--config", metavar="FILE", help="YAML run config (default: configs/demo.yaml)")
    parser.add_argument(
        "--set",
        dest="overrides",
        metavar="PATH=VALUE",
        action="append",
        default=[],
        help="override one field, e.g. --set rl.sampling.temperature=0.7 (repeatable; value parsed as YAML)",
    )
