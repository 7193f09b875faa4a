"""TEST INSTRUMENT: a stand-in `vllm` executable for machines without vLLM.

It accepts exactly the `vllm serve` flags the launcher emits (argparse rejects
anything else), checks the ones whose absence would break RL (processed
logprobs, dev-mode endpoints, an importable worker extension), and then serves
the embedded JAX engine on that command line. So the real launch, supervision
and reload code paths run against it.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from legorl_jax.commands import serve_cmd


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="vllm")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve")
    serve.add_argument("model")
    serve.add_argument("--host", required=True)
    serve.add_argument("--port", type=int, required=True)
    serve.add_argument("--served-model-name", required=True)
    serve.add_argument("--max-model-len", type=int, required=True)
    serve.add_argument("--max-num-seqs", type=int, required=True)
    serve.add_argument("--logprobs-mode", choices=("raw_logprobs", "processed_logprobs", "raw_logits", "processed_logits"))
    serve.add_argument("--return-tokens-as-token-ids", action="store_true")
    serve.add_argument("--generation-config", default="auto")
    serve.add_argument("--worker-extension-cls", default="")
    args = parser.parse_args(argv)
    if os.environ.get("VLLM_SERVER_DEV_MODE") != "1":
        parser.error("VLLM_SERVER_DEV_MODE=1 is required for /pause, /collective_rpc, /reset_prefix_cache, /resume")
    if args.logprobs_mode != "processed_logprobs":
        parser.error("the embedded engine only reports processed logprobs")
    if args.worker_extension_cls:
        module, _, name = args.worker_extension_cls.rpartition(".")
        if not hasattr(getattr(importlib.import_module(module), name), "reload_weights_from_path"):
            parser.error(f"{args.worker_extension_cls} has no reload_weights_from_path")
    engine_args = argparse.Namespace(
        model=args.model,
        host=args.host,
        port=args.port,
        served_model_name=args.served_model_name,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        max_chunk=32,
        dtype="float32",
        kv_cache_dtype="auto",
        kv_cache_memory_bytes=None,
        return_tokens_as_token_ids=args.return_tokens_as_token_ids,
        shutdown_grace_s=serve_cmd.DEFAULT_SHUTDOWN_GRACE_S,
    )
    return serve_cmd.run(engine_args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
