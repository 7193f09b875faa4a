"""`legorl rollout-server`: one GPU (or CPU) host of the rollout fleet."""

from __future__ import annotations

import argparse
import asyncio
import logging

from legorl_jax.commands import add_config_arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--address",
        default="0.0.0.0:50051",
        help="gRPC listen address (default: %(default)s); plaintext and open unless fleet.security sets "
        "tls_cert/tls_key and token_env or token_file",
    )
    parser.add_argument(
        "--model", metavar="DIR", default=None, help="HF model directory the engine serves (default: model.path)"
    )
    parser.add_argument(
        "--drain-s", type=float, default=300.0, help="on SIGTERM, seconds in-flight trials get to finish"
    )
    add_config_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from legorl_jax.config import ConfigError, load_config
    from rollout_server.server import RolloutServer

    config = load_config(args.config, args.overrides)
    model_dir = args.model or config.model.path
    if model_dir is None:
        raise ConfigError("no model: pass --model DIR or set model.path")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    asyncio.run(RolloutServer(config, model_dir, address=args.address).serve_forever(args.drain_s))
    return 0
