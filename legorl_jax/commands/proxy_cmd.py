"""`legorl proxy`: the token-capture proxy on its own, in front of any engine
with vLLM's HTTP surface, to collect trajectories from any harness or to
evaluate. Sessions are made through its admin API. The model id and the
context length come from the engine, which it waits for at start (a
deployment starts both at once), unless given on the command line."""

from __future__ import annotations

import argparse
import gc
import logging
import secrets
import sys
import time
from typing import Any

from legorl_jax.commands import add_config_arguments, load_command_config
from legorl_jax.commands.serve_cmd import add_shutdown_grace_argument, seconds_arg
from legorl_jax.core import log_redaction

DEFAULT_ENGINE_WAIT_S = 120.0
# Seconds between the engine wait's tries, and between its progress lines.
_POLL_S, _REPORT_S = 1.0, 5.0


def _context_length(value: object) -> int:
    """A context length, from the command line (text) or the engine (JSON): an integer > 1."""
    number = int(value) if isinstance(value, str) and value.strip().isdecimal() else value
    if isinstance(number, bool) or not isinstance(number, int) or number <= 1:
        raise argparse.ArgumentTypeError(f"a context length is an integer > 1, got {value!r}")
    return number


def _positive_seconds(text: str) -> float:
    """An argparse type: a finite number of seconds > 0."""
    value = seconds_arg(text)
    if value == 0:
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text!r}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--engine-url", required=True, metavar="URL", help="engine base URL (vLLM or `legorl serve`)")
    parser.add_argument(
        "--model", required=True, metavar="DIR", help="HF model directory: its tokenizer and chat template"
    )
    parser.add_argument("--host", default=None, help="bind address (default: proxy.host of the config)")
    parser.add_argument("--port", type=int, default=None, help="port (default: proxy.port of the config)")
    parser.add_argument(
        "--admin-token",
        default=None,
        help="Bearer token of the admin API (default: a fresh random one, printed at start)",
    )
    parser.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE",
        help="Jinja chat template used instead of the tokenizer's, e.g. one that renders tools "
        "(default: proxy.chat_template of the config)",
    )
    parser.add_argument(
        "--served-model-name", default=None, help="model id sent to the engine (default: the engine's, from /v1/models)"
    )
    parser.add_argument(
        "--max-context",
        type=_context_length,
        default=None,
        help="context length in tokens (default: the engine's max_model_len, from /v1/models)",
    )
    parser.add_argument(
        "--engine-wait-s",
        type=seconds_arg,
        default=DEFAULT_ENGINE_WAIT_S,
        metavar="S",
        help="seconds to wait at start for the engine to answer /v1/models, when the model id or "
        f"the context is to come from it (default: {DEFAULT_ENGINE_WAIT_S:g})",
    )
    parser.add_argument(
        "--session-idle-timeout-s",
        type=_positive_seconds,
        default=None,
        metavar="S",
        help="an admin-API session unused this long expires; its trajectory is kept as long again for one "
        "fetch (default: proxy.session_idle_timeout_s of the config)",
    )
    add_shutdown_grace_argument(parser)
    add_config_arguments(parser, demo_default=False)


def wait_for_engine(engine_url: str, wait_s: float) -> dict[str, Any]:
    """The engine's first `/v1/models` entry, asked until the engine answers,
    for `wait_s` seconds at most: a deployment starts the proxy beside an
    engine that may still be loading its weights. Says on stderr that it
    waits, and how long it has, every few seconds."""
    import httpx

    url = f"{engine_url.rstrip('/')}/v1/models"
    start = time.monotonic()
    deadline, report = start + wait_s, start
    with httpx.Client() as client:
        while True:
            try:
                reply = client.get(url, timeout=max(0.1, min(10.0, deadline - time.monotonic())))
                reply.raise_for_status()
                card = (reply.json().get("data") or [None])[0]
                if isinstance(card, dict):
                    return card
                problem = "no model in its answer"
            except (httpx.HTTPError, ValueError, AttributeError) as exc:
                problem = str(exc) or type(exc).__name__
            now = time.monotonic()
            if now >= deadline:
                raise SystemExit(
                    f"legorl proxy: the engine at {engine_url} did not answer {url} within {wait_s:g} s (last: "
                    f"{problem}); start it, wait longer with --engine-wait-s, or give --max-context and "
                    "--served-model-name to start without asking it"
                )
            if now >= report:
                print(
                    f"legorl proxy: waiting for the engine at {engine_url} ({now - start:.0f} of {wait_s:g} s: "
                    f"{problem})",
                    file=sys.stderr,
                    flush=True,
                )
                report = now + _REPORT_S
            time.sleep(min(_POLL_S, deadline - now))


def run(args: argparse.Namespace) -> int:
    from legorl_jax.serve.drain import serve
    from rollout_server.proxy.app import build_app
    from rollout_server.proxy.service import build_core, load_template

    config = load_command_config(args)
    if args.chat_template is not None:
        config.proxy.chat_template = args.chat_template
    if args.session_idle_timeout_s is not None:
        config.proxy.session_idle_timeout_s = args.session_idle_timeout_s
    log_redaction.configure(logging.INFO)
    # The model's files first: a mistake there is reported at once, not after the engine wait.
    try:
        template = load_template(args.model, config.proxy)
    except (OSError, ValueError) as exc:
        raise SystemExit(f"legorl proxy: cannot use the tokenizer and chat template of {args.model}: {exc}") from None
    served, max_context = args.served_model_name, args.max_context
    card: dict[str, Any] = {}
    if served is None or max_context is None:
        card = wait_for_engine(args.engine_url, args.engine_wait_s)
        served = served or card.get("id") or args.model
        if max_context is None:
            try:
                max_context = _context_length(card.get("max_model_len"))
            except argparse.ArgumentTypeError as exc:
                raise SystemExit(
                    f"legorl proxy: the engine at {args.engine_url} gives no usable context length "
                    f"(max_model_len in /v1/models: {exc}); give it with --max-context"
                ) from None
    # `legorl serve` (its card's owner) computes prompt logprobs at the request's temperature; any other
    # engine is taken for vLLM, which computes them at temperature 1.
    core = build_core(
        args.model,
        args.engine_url,
        served_model=served,
        max_context=max_context,
        config=config.proxy,
        template=template,
        unit_temperature_prompt_logprobs=card.get("owned_by") != "legorl",
    )
    admin_token = args.admin_token or secrets.token_urlsafe(24)
    app = build_app(
        core,
        keepalive_s=config.proxy.keepalive_s,
        admin_token=admin_token,
        max_request_bytes=config.proxy.max_request_bytes,
    )
    if not args.admin_token:
        print(f"legorl proxy: admin token {admin_token}", file=sys.stderr, flush=True)
    print(
        f"legorl proxy: engine {args.engine_url} (model {served!r}, context {max_context})", file=sys.stderr, flush=True
    )
    # Start-up objects live as long as the proxy; frozen, a full collection no longer walks them
    # (each one stalled every session; docs/benchmarks.md, Proxy).
    gc.freeze()
    # No access log: a line per model call is I/O on the hot path; the trajectory records every call.
    serve(
        app,
        grace_s=args.shutdown_grace_s,
        host=args.host or config.proxy.host,
        port=config.proxy.port if args.port is None else args.port,
        log_level="info",
        access_log=False,
        lifespan="off",
    )
    return 0
