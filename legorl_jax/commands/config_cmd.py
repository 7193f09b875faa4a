"""`legorl config show|schema`."""

from __future__ import annotations

import argparse
import json

from legorl_jax.commands import add_config_arguments, load_command_config
from legorl_jax.core.config import Config, dump_config


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    show = sub.add_parser("show", help="print the resolved config as YAML")
    add_config_arguments(show, demo_default=True)
    sub.add_parser("schema", help="print the JSON schema of the config")


def run(args: argparse.Namespace) -> int:
    if args.action == "schema":
        print(json.dumps(Config.model_json_schema(), indent=2))
    else:
        print(dump_config(load_command_config(args)), end="")
    return 0
