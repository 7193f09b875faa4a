"""`legorl serve`: the embedded JAX inference engine behind vLLM's HTTP surface."""

from __future__ import annotations

import argparse
import logging
import math
from pathlib import Path

from legorl_jax.core import log_redaction
from legorl_jax.core.body_limit import DEFAULT_MAX_REQUEST_BYTES

DEFAULT_SHUTDOWN_GRACE_S = 10.0


def seconds_arg(text: str) -> float:
    """An argparse type: a finite number of seconds, 0 or more."""
    value = float(text)
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0, got {text!r}")
    return value


def add_shutdown_grace_argument(parser: argparse.ArgumentParser) -> None:
    """--shutdown-grace-s, shared with `legorl proxy`."""
    parser.add_argument(
        "--shutdown-grace-s",
        type=seconds_arg,
        default=DEFAULT_SHUTDOWN_GRACE_S,
        metavar="S",
        help="on SIGTERM/SIGINT, seconds in-flight requests may still run; then they end with an error "
        f"and the process exits (default: {DEFAULT_SHUTDOWN_GRACE_S:g})",
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", required=True, metavar="DIR", help="HF model directory (config.json, safetensors, tokenizer)"
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", default=None, help="model id clients send (default: the --model path)")
    parser.add_argument(
        "--lora-adapter", default=None, metavar="DIR",
        help="a PEFT adapter directory merged onto --model at start: a rollout host restarting its engine on a "
        "LoRA run's adapter version",
    )  # fmt: skip
    parser.add_argument("--max-num-seqs", type=int, default=32, help="sequences decoded together (default: 32)")
    parser.add_argument(
        "--max-model-len", type=int, default=None,
        help="context length (prompt + completion; default: the checkpoint's max_position_embeddings, as vLLM); "
        "costs nothing until used: memory is the KV pool",
    )  # fmt: skip
    parser.add_argument("--max-chunk", type=int, default=512, help="largest prefill chunk per step")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument(
        "--kv-cache-dtype", choices=("auto", "float32", "bfloat16"), default="auto",
        help="K/V storage (auto: the compute dtype)",
    )  # fmt: skip
    parser.add_argument(
        "--kv-cache-memory-bytes", type=int, default=None, metavar="N",
        help="bytes of the KV-cache pool (default: the weights' size, 512 MiB or one --max-model-len sequence, "
        "whichever is most, and no more than --max-num-seqs full-length sequences use); "
        "requests beyond it wait",
    )  # fmt: skip
    parser.add_argument(
        "--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
        help="reuse the K/V of a prompt prefix already computed (vLLM's flag of the same name; default: on)",
    )  # fmt: skip
    parser.add_argument(
        "--return-tokens-as-token-ids",
        action="store_true",
        help="write logprob tokens as 'token_id:<id>' (vLLM's flag of the same name)",
    )
    parser.add_argument(
        "--max-request-bytes",
        type=int,
        default=DEFAULT_MAX_REQUEST_BYTES,
        metavar="N",
        help=f"largest request body taken (/v1/completions, /tokenize, ...); larger ones get 413 "
        f"(default: {DEFAULT_MAX_REQUEST_BYTES})",
    )
    add_shutdown_grace_argument(parser)


def run(args: argparse.Namespace) -> int:
    for name in ("max_num_seqs", "max_model_len", "max_chunk", "kv_cache_memory_bytes"):
        if (getattr(args, name) or 1) <= 0:
            raise SystemExit(f"legorl serve: --{name.replace('_', '-')} must be positive")
    # Checked before the heavy imports, so a wrong path fails in well under a second.
    if not (Path(args.model) / "config.json").is_file():
        raise SystemExit(f"legorl serve: {args.model}: not an HF model directory (no config.json)")
    from legorl_jax.serve.app import create_app
    from legorl_jax.serve.drain import serve
    from legorl_jax.serve.loader import WeightsError, load_served_model

    log_redaction.configure(logging.INFO)
    try:
        served = load_served_model(
            args.model,
            max_slots=args.max_num_seqs,
            max_len=args.max_model_len,
            max_chunk=args.max_chunk,
            dtype=args.dtype,
            kv_cache_dtype=args.kv_cache_dtype,
            kv_cache_memory_bytes=args.kv_cache_memory_bytes,
            enable_prefix_caching=args.enable_prefix_caching,
            served_name=args.served_model_name,
        )
        if args.lora_adapter is not None:
            served.reload(args.lora_adapter)
    except WeightsError as exc:
        raise SystemExit(f"legorl serve: {exc}") from None
    try:
        app = create_app(
            served,
            return_tokens_as_token_ids=args.return_tokens_as_token_ids,
            max_request_bytes=args.max_request_bytes,
        )
        serve(app, grace_s=args.shutdown_grace_s, host=args.host, port=args.port, log_level="info", lifespan="off")
    finally:
        served.engine.shutdown()
    return 0
