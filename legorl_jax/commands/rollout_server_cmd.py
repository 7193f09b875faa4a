"""`legorl rollout-server`: one GPU (or CPU) host of the rollout fleet."""

from __future__ import annotations

import argparse
import asyncio
import logging

from legorl_jax.commands import add_config_arguments, load_command_config
from legorl_jax.core import log_redaction


def _seconds(text: str) -> float:
    value = float(text)
    if not value >= 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"expected seconds >= 0, got {text}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--address",
        default="127.0.0.1:50051",
        help="gRPC listen address (default: %(default)s, this host only). Any other address needs a bearer "
        "token (fleet.security.token_env or token_file); add tls_cert/tls_key to encrypt the traffic",
    )
    parser.add_argument(
        "--insecure-no-auth",
        action="store_true",
        help="listen on a non-loopback --address without a bearer token: anyone who reaches the port can run "
        "code in sandboxes and replace the weights. Only for a network nobody else can reach",
    )
    parser.add_argument(
        "--model", metavar="DIR", default=None, help="HF model directory the engine serves (default: model.path)"
    )
    parser.add_argument(
        "--drain-s",
        type=_seconds,
        default=300.0,
        help="on SIGTERM, seconds in-flight trials get to finish (default: %(default)s); then the rest are "
        "cancelled and reported as CANCELLED, and the server exits within about a minute more",
    )
    add_config_arguments(parser, demo_default=False)


def run(args: argparse.Namespace) -> int:
    from legorl_jax.core.config import ConfigError
    from rollout_server.server import RolloutServer

    config = load_command_config(args)
    model_dir = args.model or config.model.path
    if model_dir is None:
        raise ConfigError("no model: pass --model DIR or set model.path")
    log_redaction.configure(logging.INFO)
    server = RolloutServer(config, model_dir, address=args.address, insecure_no_auth=args.insecure_no_auth)
    asyncio.run(server.serve_forever(args.drain_s))
    return 0
