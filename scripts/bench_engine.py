#!/usr/bin/env python
"""Benchmark: the embedded JAX engine against `transformers` (torch, CPU) on the
same random weights at a real model's shape, in one run.

Each side runs in its own subprocess, so each one's peak resident memory is its
own. Per batch size both generate `--new-tokens` tokens from the same random
prompts (greedy, EOS ignored); each side runs once untimed first (JAX compiles,
torch warms up), then once timed. Reported:

- decode rows: generated tokens/s of each side and their ratio; for batch 1 the
  machine's bound too (weight bytes read per token / memory bandwidth, the
  bandwidth measured in this run by a large copy);
- a long-prompt row: seconds to prefill `--long-prompt` tokens (engine: one
  request, max_tokens=1) against one transformers forward of the same prompt;
- a prefix-cache row: a 4-turn episode whose turns extend the previous prompt;
  the engine's prefill time per turn and the prefix-cache hit rate;
- peak resident memory of the engine process against weights + the KV it used.

    .venv/bin/python scripts/bench_engine.py --shape smollm2-135m [--batches 1 8 32] [--long-prompt 32768]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

SHAPES: dict[str, dict[str, Any]] = {
    "smollm2-135m": dict(
        arch="llama", vocab_size=49152, hidden_size=576, num_layers=30, num_heads=9, num_kv_heads=3,
        head_dim=64, intermediate_size=1536,
    ),
    "qwen3-0.6b": dict(
        arch="qwen3", vocab_size=151936, hidden_size=1024, num_layers=28, num_heads=16, num_kv_heads=8,
        head_dim=128, intermediate_size=3072,
    ),
    "tiny": dict(
        arch="qwen3", vocab_size=8192, hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=4,
        head_dim=32, intermediate_size=768,
    ),
}  # fmt: skip


def progress(side: str, what: str) -> None:
    """A line on stderr per finished measurement: a long run shows where it is."""
    print(f"[{side} {time.strftime('%H:%M:%S')}] {what}", file=sys.stderr, flush=True)


def peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB


def memory_bandwidth_gbs() -> float:
    """Best of a few 1 GiB copies: bytes read + written per second."""
    src = np.ones(2**27, np.float64)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - start)
    return 2 * src.nbytes / best / 1e9


def prompts_for(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    return np.random.default_rng(seed).integers(300, vocab, (batch, length)).tolist()


def engine_generate(engine: Any, prompts: list[list[int]], new_tokens: int) -> float:
    """Seconds to generate new_tokens for every prompt, all submitted at once."""
    from legorl_jax.serve.request_types import FinishEvent, GenRequest, SamplingParams

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
    if not done.wait(timeout=7200):
        raise RuntimeError("engine benchmark timed out")
    return time.perf_counter() - start


def run_engine(args: argparse.Namespace, model_dir: Path) -> dict[str, Any]:
    import jax

    from legorl_jax.models.kv_cache import kv_bytes_per_token
    from legorl_jax.serve.loader import BLOCK_SIZE, load_served_model

    max_len = max(args.prompt_tokens + args.new_tokens, args.long_prompt + 1, args.episode_tokens())
    served = load_served_model(model_dir, max_slots=max(args.batches), max_len=max_len)
    engine = served.engine
    out: dict[str, Any] = {"decode": {}, "rss_start_gb": peak_rss_gb()}
    weight_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(engine._state))
    per_token = kv_bytes_per_token(served.config)
    kv_peak_tokens = 0
    try:
        for batch in args.batches:
            prompts = prompts_for(batch, args.prompt_tokens, served.config.vocab_size, batch)
            engine_generate(engine, prompts, args.new_tokens)  # compile
            out["decode"][batch] = engine_generate(engine, prompts, args.new_tokens)
            progress("engine", f"batch {batch}: {out['decode'][batch]:.1f} s")
            kv_peak_tokens = max(kv_peak_tokens, batch * (args.prompt_tokens + args.new_tokens))
        out["rss_decode_gb"] = peak_rss_gb()
        if args.long_prompt:
            long = prompts_for(1, args.long_prompt, served.config.vocab_size, 99)
            engine.reset_cache()
            engine_generate(engine, long, 1)  # compile every window on the way
            engine.reset_cache()
            out["long"] = engine_generate(engine, long, 1)
            progress("engine", f"prefill of {args.long_prompt}: {out['long']:.1f} s")
            kv_peak_tokens = max(kv_peak_tokens, args.long_prompt + 1)
        for _ in range(2):  # the first compiles the windows on the way
            engine.reset_cache()
            out["episode"] = episode(engine, args, served.config.vocab_size)
        stats = engine.stats()
        out["kv_pool_gb"] = (stats["kv_blocks_total"] + 1) * BLOCK_SIZE * per_token / 1e9
    finally:
        engine.shutdown()
    out["weights_gb"] = weight_bytes / 1e9
    out["kv_used_gb"] = kv_peak_tokens * per_token / 1e9
    out["rss_gb"] = peak_rss_gb()
    return out


def episode(engine: Any, args: argparse.Namespace, vocab: int) -> list[tuple[float, int, int]]:
    """(seconds, prompt tokens, prefix-cache hit tokens) of each turn of an agent
    episode: every turn's prompt is the previous prompt, its completion and
    `--turn-tokens` new tokens."""
    from legorl_jax.serve.request_types import GenRequest, SamplingParams, TokenEvent

    rng = np.random.default_rng(5)
    prompt = rng.integers(300, vocab, args.first_turn).tolist()
    times = []
    for turn in range(4):
        got: list[int] = []
        done = threading.Event()

        def sink(event: object, got: list[int] = got, done: threading.Event = done) -> None:
            if isinstance(event, TokenEvent):
                got.append(event.token)
                done.set()

        hits = engine.stats()["prefix_cache_hits"]
        start = time.perf_counter()
        engine.submit(GenRequest(f"turn-{turn}", prompt, SamplingParams(max_tokens=1, temperature=0.0), sink))
        done.wait(timeout=7200)
        times.append((time.perf_counter() - start, len(prompt), engine.stats()["prefix_cache_hits"] - hits))
        prompt = prompt + got + rng.integers(300, vocab, args.turn_tokens).tolist()
    return times


def run_hf(args: argparse.Namespace, model_dir: Path) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    vocab = model.config.vocab_size
    out: dict[str, Any] = {"decode": {}, "threads": torch.get_num_threads()}

    def generate(prompts: list[list[int]], new: int) -> float:
        ids = torch.tensor(prompts)
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                do_sample=False, pad_token_id=0,
            )  # fmt: skip
        return time.perf_counter() - start

    for batch in args.batches:
        prompts = prompts_for(batch, args.prompt_tokens, vocab, batch)
        generate(prompts, 2)  # warm-up
        out["decode"][batch] = generate(prompts, args.new_tokens)
        progress("hf", f"batch {batch}: {out['decode'][batch]:.1f} s")
    if args.long_prompt:
        ids = torch.tensor(prompts_for(1, args.long_prompt, vocab, 99))
        with torch.inference_mode():
            start = time.perf_counter()
            model(input_ids=ids, logits_to_keep=1)
            out["long"] = time.perf_counter() - start
    out["rss_gb"] = peak_rss_gb()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-135m")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--long-prompt", type=int, default=32768, help="0 skips the long-prompt row")
    parser.add_argument("--first-turn", type=int, default=10000, help="first prompt of the 4-turn episode")
    parser.add_argument("--turn-tokens", type=int, default=500, help="tokens each later turn adds")
    parser.add_argument("--side", choices=("engine", "hf"), help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if min(args.batches) < 1 or args.prompt_tokens < 1 or args.new_tokens < 1 or args.long_prompt < 0:
        parser.error("batches, --prompt-tokens and --new-tokens must be positive")
    args.episode_tokens = lambda: args.first_turn + 4 * (args.turn_tokens + 1)
    if args.side:
        result = (run_engine if args.side == "engine" else run_hf)(args, args.model_dir)
        print(json.dumps(result))
        return 0

    from legorl_jax.models.demo_assets import build_tiny_hf_model

    shape = SHAPES[args.shape]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_hf_model(Path(tmp) / args.shape, **shape)
        sides = {}
        for side in ("engine", "hf"):
            cmd = [sys.executable, __file__, *sys.argv[1:], "--side", side, "--model-dir", str(model_dir)]
            done = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True)
            sides[side] = json.loads(done.stdout.strip().splitlines()[-1])
    engine, hf = sides["engine"], sides["hf"]
    bandwidth = memory_bandwidth_gbs()
    print(f"shape {args.shape} {shape}; prompt {args.prompt_tokens}, new {args.new_tokens} tokens; "
          f"torch threads {hf['threads']}; memory bandwidth {bandwidth:.1f} GB/s")  # fmt: skip
    print(f"{'batch':>5} {'engine tok/s':>13} {'hf tok/s':>10} {'ratio':>7}")
    for batch in args.batches:
        tokens = batch * args.new_tokens
        e, h = engine["decode"][str(batch)], hf["decode"][str(batch)]
        print(f"{batch:>5} {tokens / e:>13.1f} {tokens / h:>10.1f} {h / e:>6.2f}x")
    # Batch-1 decode reads every weight once per token (the KV read is small beside it).
    bound = bandwidth / engine["weights_gb"]
    if 1 in args.batches:
        e1 = args.new_tokens / engine["decode"]["1"]
        print(f"batch-1 bound: {bound:.1f} tok/s ({engine['weights_gb']:.2f} GB of weights / {bandwidth:.1f} GB/s); "
              f"engine at {e1 / bound:.0%} of it (includes prefill of the prompt)")  # fmt: skip
    if args.long_prompt:
        print(f"prefill of {args.long_prompt} tokens: engine {engine['long']:.1f} s, one transformers forward "
              f"{hf['long']:.1f} s ({engine['long'] / hf['long']:.2f}x)")  # fmt: skip
    turns = "; ".join(f"{s:.2f} s, {hit}/{n} cached" for s, n, hit in engine["episode"])
    later = engine["episode"][1:]
    rate = sum(hit for _, _, hit in later) / sum(n for _, n, _ in later)
    print(f"4-turn episode ({args.first_turn} + {args.turn_tokens}/turn tokens), engine per turn: {turns}; "
          f"prefix-cache hit rate of turns 2-4 {rate:.1%}")  # fmt: skip
    print(f"peak RSS: engine {engine['rss_gb']:.2f} GB (after load {engine['rss_start_gb']:.2f} GB, "
          f"after decode rows {engine['rss_decode_gb']:.2f} GB; "
          f"weights {engine['weights_gb']:.2f} GB + KV used {engine['kv_used_gb']:.2f} GB, "
          f"pool {engine['kv_pool_gb']:.2f} GB); transformers {hf['rss_gb']:.2f} GB")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
