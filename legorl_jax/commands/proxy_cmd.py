"""`legorl proxy`: the token-capture proxy on its own, in front of any engine
with vLLM's HTTP surface, to collect trajectories from any harness or to
evaluate. Sessions are made through its admin API."""

from __future__ import annotations

import argparse
import gc
import logging
import secrets
import sys
from typing import Any

from legorl_jax.commands import add_config_arguments
from legorl_jax.commands.serve_cmd import add_shutdown_grace_argument


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--engine-url", required=True, metavar="URL", help="engine base URL (vLLM or `legorl serve`)")
    parser.add_argument("--model", required=True, metavar="DIR",
                        help="HF model directory: its tokenizer and chat template")
    parser.add_argument("--host", default=None, help="bind address (default: proxy.host of the config)")
    parser.add_argument("--port", type=int, default=None, help="port (default: proxy.port of the config)")
    parser.add_argument("--admin-token", default=None,
                        help="Bearer token of the admin API (default: a fresh random one, printed at start)")
    parser.add_argument("--served-model-name", default=None,
                        help="model id sent to the engine (default: ask the engine)")
    parser.add_argument("--max-context", type=int, default=None,
                        help="context length in tokens (default: the engine's max_model_len, else engine.max_context)")
    add_shutdown_grace_argument(parser)
    add_config_arguments(parser)


def engine_model_card(engine_url: str) -> dict[str, Any]:
    """The engine's first `/v1/models` entry, or {} when it cannot be asked."""
    import httpx

    try:
        data = httpx.get(f"{engine_url.rstrip('/')}/v1/models", timeout=10).json().get("data") or [{}]
    except (httpx.HTTPError, ValueError, AttributeError):
        return {}
    return data[0] if isinstance(data[0], dict) else {}


def run(args: argparse.Namespace) -> int:
    from legorl_jax.config import load_config
    from legorl_jax.serve.drain import serve
    from rollout_server.proxy.app import build_app
    from rollout_server.proxy.service import build_core

    config = load_config(args.config, args.overrides)
    card = engine_model_card(args.engine_url)
    served = args.served_model_name or card.get("id") or args.model
    max_context = args.max_context or card.get("max_model_len") or config.engine.max_context
    if isinstance(max_context, bool) or not isinstance(max_context, int) or max_context <= 1:
        raise SystemExit(f"legorl proxy: --max-context must be an integer > 1, got {max_context!r}")
    try:
        core = build_core(args.model, args.engine_url, served_model=served, max_context=max_context,
                          config=config.proxy)
    except (OSError, ValueError) as exc:
        raise SystemExit(f"legorl proxy: cannot use the tokenizer of {args.model}: {exc}") from None
    admin_token = args.admin_token or secrets.token_urlsafe(24)
    app = build_app(core, keepalive_s=config.proxy.keepalive_s, admin_token=admin_token)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if not args.admin_token:
        print(f"legorl proxy: admin token {admin_token}", file=sys.stderr, flush=True)
    print(f"legorl proxy: engine {args.engine_url} (model {served!r}, context {max_context})",
          file=sys.stderr, flush=True)
    # Start-up objects live as long as the proxy; frozen, a full collection no longer walks them
    # (it stalled every session ~200 ms every few thousand calls).
    gc.freeze()
    # No access log: a line per model call is I/O on the hot path; the trajectory records every call.
    serve(app, grace_s=args.shutdown_grace_s, host=args.host or config.proxy.host,
          port=config.proxy.port if args.port is None else args.port, log_level="info", access_log=False,
          lifespan="off")
    return 0
