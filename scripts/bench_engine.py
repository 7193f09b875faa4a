#!/usr/bin/env python
"""Benchmark: decode throughput of the embedded JAX engine against
`transformers` `generate` (torch, CPU) on the same weights, in one run.

A small random Qwen3 is written once; then, per batch size, both generate the
same number of new tokens from the same random prompts (greedy, EOS ignored).
Each side runs once untimed first (JAX compiles, torch warms its kernels), then
once timed. Reported: generated tokens/s of each and their ratio. The engine
runs in-process with as many slots as the largest batch, as `legorl serve` does.

    .venv/bin/python scripts/bench_engine.py [--batches 1 8 32] [--new-tokens 64]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

MODEL = dict(hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=4, head_dim=32, intermediate_size=768)


def engine_run(served: object, prompts: list[list[int]], new_tokens: int) -> float:
    """Seconds to generate new_tokens for every prompt, all submitted at once."""
    from legorl_jax.serve.engine import FinishEvent, GenRequest, SamplingParams

    engine = served.engine  # type: ignore[attr-defined]
    remaining = len(prompts)
    done = threading.Event()
    lock = threading.Lock()

    def sink(event: object) -> None:
        nonlocal remaining
        if isinstance(event, FinishEvent):
            with lock:
                remaining -= 1
                if remaining == 0:
                    done.set()

    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.submit(GenRequest(f"bench-{i}", prompt, params, sink))
    if not done.wait(timeout=3600):
        raise RuntimeError("engine benchmark timed out")
    return time.perf_counter() - start


def hf_run(model: object, prompts: list[list[int]], new_tokens: int) -> float:
    import torch

    ids = torch.tensor(prompts)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(  # type: ignore[attr-defined]
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    elapsed = time.perf_counter() - start
    assert out.shape[1] == ids.shape[1] + new_tokens
    return elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=8192)
    args = parser.parse_args()
    if min(args.batches) < 1 or args.prompt_tokens < 1 or args.new_tokens < 1:
        parser.error("batches, --prompt-tokens and --new-tokens must be positive")

    import torch
    from transformers import AutoModelForCausalLM

    from legorl_jax.models.demo_assets import build_tiny_hf_model
    from legorl_jax.serve.loader import load_served_model

    rng = np.random.default_rng(0)
    max_len = args.prompt_tokens + args.new_tokens
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_hf_model(Path(tmp) / "qwen3", vocab_size=args.vocab, **MODEL)
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        served = load_served_model(model_dir, max_slots=max(args.batches), max_len=max_len, max_chunk=args.prompt_tokens)
        print(f"qwen3 {MODEL} vocab={args.vocab}; prompt {args.prompt_tokens}, new {args.new_tokens} tokens; "
              f"torch threads {torch.get_num_threads()}")
        print(f"{'batch':>5} {'engine tok/s':>13} {'hf tok/s':>10} {'ratio':>7}")
        try:
            for batch in args.batches:
                prompts = rng.integers(300, args.vocab, (batch, args.prompt_tokens)).tolist()
                tokens = batch * args.new_tokens
                engine_run(served, prompts, args.new_tokens)  # compile
                engine_s = engine_run(served, prompts, args.new_tokens)
                hf_run(hf, prompts, args.new_tokens)  # warm-up
                hf_s = hf_run(hf, prompts, args.new_tokens)
                print(f"{batch:>5} {tokens / engine_s:>13.1f} {tokens / hf_s:>10.1f} {hf_s / engine_s:>6.2f}x")
        finally:
            served.engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
