"""`legorl view RUN_DIR`: a local web app showing a run's curves, rollouts and trajectories, live."""

from __future__ import annotations

import argparse
import socket
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "run_dir", metavar="RUN_DIR", help="a run directory (metrics.jsonl, rollouts.jsonl), e.g. runs/demo"
    )
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (default: 127.0.0.1, this machine only; the viewer has no authentication)",
    )
    parser.add_argument("--port", type=int, default=8008, help="port to listen on (default: 8008)")


def run(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        print(f"legorl view: {run_dir} is not a directory (give a run directory such as runs/demo)")
        return 1
    # Bound here, before the address is printed: a port in use is said plainly, not after a "serving at" line.
    try:
        family = socket.getaddrinfo(args.host, args.port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.create_server((args.host, args.port), family=family)
    except OSError as exc:
        print(f"legorl view: cannot listen on {args.host}:{args.port}: {exc}")
        return 1
    import uvicorn

    from legorl_jax.view.app import create_app

    print(f"legorl view: {run_dir} at http://{args.host}:{args.port}/ (Ctrl-C to stop)", flush=True)
    uvicorn.Server(uvicorn.Config(create_app(run_dir), log_level="warning")).run(sockets=[sock])
    return 0
