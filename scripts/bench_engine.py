#!/usr/bin/env python
"""Benchmark: the embedded JAX engine against `transformers` (torch, CPU) on the
same random weights at a real model's shape, in one run.

Each side runs in its own worker subprocess, so each one's peak resident memory
is its own. Both workers load first; then the parent asks them for one
measurement at a time, alternating sides: per row an untimed run on each side
(JAX compiles, torch warms up), then `--repeats` timed runs, engine and
transformers in turn, and the median of each side. On a shared machine, load
that comes and goes then falls on both sides of a row's ratio, not on all of
one side's rows; each figure is also printed on stderr as it is measured. The engine's
untimed run is the row itself (every shape it meets compiles); transformers'
is a short generate (it compiles nothing). `--cold` skips the untimed runs, for
a row that only has to work: its time then includes compiling. Reported:

- decode rows: generated tokens/s of each side and their ratio; then each
  side's prefill alone (the same prompts, one new token) and its decode rate
  without it (batch x (new - 1) tokens over the row's time less its prefill),
  as vLLM's benchmarks split time to first token from time per output token;
  for batch 1 the machine's bound too (weight bytes read per token / memory
  bandwidth, the bandwidth measured in this run by a large copy);
- a long-prompt row: seconds to prefill `--long-prompt` tokens (engine: one
  request, max_tokens=1) against one transformers forward of the same prompt
  (`--engine-only` skips transformers, e.g. for a prompt too long for it);
- a prefix-cache row: a 4-turn episode whose turns extend the previous prompt;
  the engine's prefill time per turn and the prefix-cache hit rate;
- peak resident memory of the engine process against weights + the KV it used.

The engine worker runs with the malloc settings `legorl` itself applies
(`legorl_jax.core.allocator`; `--engine-malloc default` keeps glibc's), the
transformers worker with glibc's defaults, as a user running transformers has
them (`--hf-malloc tuned` gives it the engine's).

`--num-layers` overrides the shape's depth: a row too slow at full depth runs
at fewer layers, and its ratio is then per layer (the LM head is not).

    .venv/bin/python scripts/bench_engine.py --shape smollm2-135m [--batches 1 8 32] [--long-prompt 32768]
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from legorl_jax.core.allocator import keep_freed_memory  # noqa: E402

# Before numpy or any thread exists (see the module); the parent sets
# LEGORL_MALLOC per worker, so this is what decides each side's allocator.
keep_freed_memory()

import numpy as np  # noqa: E402

SHAPES: dict[str, dict[str, Any]] = {
    "smollm2-135m": dict(
        arch="llama", vocab_size=49152, hidden_size=576, num_layers=30, num_heads=9, num_kv_heads=3,
        head_dim=64, intermediate_size=1536, max_position_embeddings=8192,
    ),
    "qwen3-0.6b": dict(
        arch="qwen3", vocab_size=151936, hidden_size=1024, num_layers=28, num_heads=16, num_kv_heads=8,
        head_dim=128, intermediate_size=3072, max_position_embeddings=40960,
    ),
    "tiny": dict(
        arch="qwen3", vocab_size=8192, hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=4,
        head_dim=32, intermediate_size=768, max_position_embeddings=4096,
    ),
}  # fmt: skip

# Marks a worker's answer on its stdout: libraries may print there too.
ANSWER = "@bench "


def progress(side: str, what: str) -> None:
    """A line on stderr per finished measurement: a long run shows where it is."""
    print(f"[{side} {time.strftime('%H:%M:%S')}] {what}", file=sys.stderr, flush=True)


def peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB


def memory_bandwidth_gbs() -> float:
    """Best of a few 1 GiB copies: bytes read + written per second.

    Both buffers are page-aligned (anonymous maps): from the heap, where this
    process's malloc settings put them, their addresses can differ by a few
    cache lines modulo 4 KiB, and such a copy ran at a third of the speed
    (8 against 25 GB/s on one machine), which would lower the bound.
    """
    size = 2**30
    src = np.frombuffer(mmap.mmap(-1, size), np.float64)
    dst = np.frombuffer(mmap.mmap(-1, size), np.float64)
    src.fill(1.0)
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


class EngineSide:
    """The engine at `legorl serve`'s defaults (`load_served_model`'s) but for
    its context, which grows past the checkpoint's to fit the longest row asked for."""

    def __init__(self, args: argparse.Namespace, model_dir: Path) -> None:
        import jax

        from legorl_jax.models.kv_cache import kv_bytes_per_token
        from legorl_jax.serve.loader import DEFAULT_MAX_NUM_SEQS, load_served_model, trained_context

        self.args = args
        # Only what differs from the defaults is passed.
        overrides: dict[str, Any] = {}
        needed = max(args.prompt_tokens + args.new_tokens, args.long_prompt + 1, args.episode_tokens)
        if needed > trained_context(model_dir):
            overrides["max_len"] = needed
        if max(args.batches, default=0) > DEFAULT_MAX_NUM_SEQS:
            overrides["max_slots"] = max(args.batches)
        if args.kv_cache_gb:
            overrides["kv_cache_memory_bytes"] = int(args.kv_cache_gb * 1e9)
        self.served = load_served_model(model_dir, **overrides)
        self.engine = self.served.engine
        self.vocab = self.served.config.vocab_size
        self.rss_start_gb = peak_rss_gb()
        self.weight_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(self.engine._state))
        self.per_token = kv_bytes_per_token(self.served.config)
        self.kv_peak_tokens = 0
        self.rss_decode_gb = 0.0

    def warm(self, op: str, *args: Any) -> None:
        getattr(self, op)(*args)

    def decode(self, batch: int, new_tokens: int | None = None) -> float:
        self.kv_peak_tokens = max(self.kv_peak_tokens, batch * (self.args.prompt_tokens + self.args.new_tokens))
        prompts = prompts_for(batch, self.args.prompt_tokens, self.vocab, batch)
        # Every run prefills its prompts, as transformers does: without this the
        # prefix cache would serve the untimed run's prompts to the timed one.
        self.engine.reset_cache()
        seconds = engine_generate(self.engine, prompts, new_tokens or self.args.new_tokens)
        self.rss_decode_gb = max(self.rss_decode_gb, peak_rss_gb())
        progress("engine", f"peak RSS so far {self.rss_decode_gb:.2f} GB")
        return seconds

    def prefill(self, batch: int) -> float:
        """The decode row's prompts to their first token."""
        return self.decode(batch, 1)

    def long(self) -> float:
        self.kv_peak_tokens = max(self.kv_peak_tokens, self.args.long_prompt + 1)
        self.engine.reset_cache()  # a repeat must prefill it all again
        return engine_generate(self.engine, prompts_for(1, self.args.long_prompt, self.vocab, 99), 1)

    def episode(self) -> list[tuple[float, int, int]]:
        self.engine.reset_cache()
        return episode(self.engine, self.args, self.vocab)

    def finish(self) -> dict[str, Any]:
        from legorl_jax.serve.loader import BLOCK_SIZE

        stats = self.engine.stats()
        self.engine.shutdown()
        return {
            "rss_start_gb": self.rss_start_gb,
            "rss_decode_gb": self.rss_decode_gb,
            "weights_gb": self.weight_bytes / 1e9,
            "kv_used_gb": self.kv_peak_tokens * self.per_token / 1e9,
            "kv_pool_gb": (stats["kv_blocks_total"] + 1) * BLOCK_SIZE * self.per_token / 1e9,
            "rss_gb": peak_rss_gb(),
        }


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


class HFSide:
    """transformers `generate` (float32, greedy) and one forward for the long row."""

    def __init__(self, args: argparse.Namespace, model_dir: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.args, self.torch = args, torch
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.vocab = self.model.config.vocab_size

    def warm(self, op: str, *args: Any) -> None:
        """A short generate: torch compiles nothing, a first call only sets up threads and allocator."""
        with self.torch.inference_mode():
            self.model.generate(input_ids=self.torch.tensor(prompts_for(1, 16, self.vocab, 0)), max_new_tokens=2)

    def decode(self, batch: int, new_tokens: int | None = None) -> float:
        torch = self.torch
        ids = torch.tensor(prompts_for(batch, self.args.prompt_tokens, self.vocab, batch))
        new = new_tokens or self.args.new_tokens
        start = time.perf_counter()
        with torch.inference_mode():
            self.model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                do_sample=False, pad_token_id=0,
            )  # fmt: skip
        return time.perf_counter() - start

    def prefill(self, batch: int) -> float:
        """The decode row's prompts to their first token."""
        return self.decode(batch, 1)

    def long(self) -> float:
        torch = self.torch
        ids = torch.tensor(prompts_for(1, self.args.long_prompt, self.vocab, 99))
        with torch.inference_mode():
            start = time.perf_counter()
            self.model(input_ids=ids, logits_to_keep=1)
            return time.perf_counter() - start

    def finish(self) -> dict[str, Any]:
        return {"rss_gb": peak_rss_gb(), "threads": self.torch.get_num_threads()}


def serve_worker(args: argparse.Namespace) -> int:
    """A worker's loop: one JSON request per stdin line ({"op": ..., "arg": ...}),
    one marked JSON answer per request on stdout; "finish" ends it."""
    side = (EngineSide if args.side == "engine" else HFSide)(args, args.model_dir)
    print(ANSWER + json.dumps("ready"), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        method = getattr(side, request["op"])
        answer = method(*request.get("args", []))
        print(ANSWER + json.dumps(answer), flush=True)
        if request["op"] == "finish":
            break
    return 0


class Worker:
    """The parent's handle on one side's worker subprocess."""

    def __init__(self, side: str, model_dir: Path, env: dict[str, str]) -> None:
        self.side = side
        cmd = [sys.executable, __file__, *sys.argv[1:], "--side", side, "--model-dir", str(model_dir)]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)

    def ask(self, op: str, *args: Any) -> Any:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        if op != "ready":
            self.proc.stdin.write(json.dumps({"op": op, "args": list(args)}) + "\n")
            self.proc.stdin.flush()
        for line in self.proc.stdout:
            if line.startswith(ANSWER):
                return json.loads(line[len(ANSWER) :])
        raise RuntimeError(f"the {self.side} worker exited (status {self.proc.wait()}) during {op!r}")


def interleaved(workers: list[Worker], args: argparse.Namespace, op: str, *op_args: Any) -> dict[str, float]:
    """Median seconds of `op` per side: one untimed run each (unless --cold),
    then `--repeats` timed runs taking turns between the sides."""
    for worker in workers if not args.cold else []:
        worker.ask("warm", op, *op_args)
    times: dict[str, list[float]] = {w.side: [] for w in workers}
    for _ in range(args.repeats):
        for worker in workers:
            times[worker.side].append(worker.ask(op, *op_args))
            progress(worker.side, f"{op}{''.join(f' {a}' for a in op_args)}: {times[worker.side][-1]:.1f} s")
    return {side: statistics.median(t) for side, t in times.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-135m")
    parser.add_argument("--num-layers", type=int, help="override the shape's depth")
    parser.add_argument("--batches", type=int, nargs="*", default=[1, 8, 32], help="none skips the decode rows")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=1, help="timed runs per side and row (median)")
    parser.add_argument("--long-prompt", type=int, default=32768, help="0 skips the long-prompt row")
    parser.add_argument("--cold", action="store_true", help="no untimed runs: times include compiling")
    parser.add_argument("--engine-only", action="store_true", help="no transformers side")
    parser.add_argument("--first-turn", type=int, default=10000, help="first prompt of the 4-turn episode; 0 skips")
    parser.add_argument("--turn-tokens", type=int, default=500, help="tokens each later turn adds")
    parser.add_argument(
        "--kv-cache-gb",
        type=float,
        help="the engine's KV pool (default: the engine's default, which may queue the largest batch)",
    )
    parser.add_argument(
        "--engine-malloc",
        choices=("default", "tuned"),
        default="tuned",
        help="the engine worker's malloc: the settings legorl applies (tuned), or glibc's defaults",
    )
    parser.add_argument(
        "--hf-malloc",
        choices=("default", "tuned"),
        default="default",
        help="the transformers worker's malloc: glibc's defaults, or the engine's settings",
    )
    parser.add_argument("--side", choices=("engine", "hf"), help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if (
        min(args.batches, default=1) < 1
        or min(args.prompt_tokens, args.new_tokens, args.repeats, args.num_layers or 1) < 1
        or min(args.long_prompt, args.first_turn, args.turn_tokens) < 0
    ):
        parser.error("batches, --prompt-tokens, --new-tokens, --repeats and --num-layers must be positive")
    if args.kv_cache_gb is not None and args.kv_cache_gb <= 0:
        parser.error(f"--kv-cache-gb must be positive, got {args.kv_cache_gb}")
    args.episode_tokens = args.first_turn + 4 * (args.turn_tokens + 1) if args.first_turn else 0
    if args.side:
        return serve_worker(args)

    from legorl_jax.models.demo_assets import build_tiny_hf_model

    shape = SHAPES[args.shape] | ({"num_layers": args.num_layers} if args.num_layers else {})
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_hf_model(Path(tmp) / args.shape, **shape)
        malloc = {"engine": args.engine_malloc, "hf": args.hf_malloc}
        workers = [
            Worker(side, model_dir, os.environ | {"LEGORL_MALLOC": malloc[side]})
            for side in ("engine", "hf")[: 1 if args.engine_only else 2]
        ]
        try:
            report(args, shape, workers)
        finally:
            for worker in workers:
                worker.proc.kill()
    return 0


def report(args: argparse.Namespace, shape: dict[str, Any], workers: list[Worker]) -> None:
    """Runs the rows through the workers and prints them."""
    for worker in workers:
        worker.ask("ready")
    bandwidth = memory_bandwidth_gbs()
    progress("bench", f"memory bandwidth {bandwidth:.1f} GB/s")
    decode = {batch: interleaved(workers, args, "decode", batch) for batch in args.batches}
    prefill = {batch: interleaved(workers, args, "prefill", batch) for batch in args.batches}
    long = interleaved(workers, args, "long") if args.long_prompt else {}
    turns = workers[0].ask("episode") if args.first_turn else None
    engine = workers[0].ask("finish")
    hf = workers[1].ask("finish") if len(workers) > 1 else None
    lengths = f"prompt {args.prompt_tokens}, new {args.new_tokens} tokens; " if decode else ""
    print(f"shape {args.shape} {shape}; {lengths}"
          f"median of {args.repeats} timed run(s) per side; memory bandwidth {bandwidth:.1f} GB/s"
          + f"; malloc: engine {args.engine_malloc}"
          + (f", transformers {args.hf_malloc}; torch threads {hf['threads']}" if hf else ""))  # fmt: skip
    if decode:
        print(f"{'batch':>5} {'engine tok/s':>13} {'hf tok/s':>10} {'ratio':>7}   {'prefill s (engine / hf)':>24}"
              f" {'decode tok/s (engine / hf)':>27} {'ratio':>7}")  # fmt: skip
    for batch, seconds in decode.items():
        tokens = batch * args.new_tokens
        e, h = seconds["engine"], seconds.get("hf", float("nan"))
        pe, ph = prefill[batch]["engine"], prefill[batch].get("hf", float("nan"))
        # Decode alone: the tokens after the first, over the row's time less its prefill.
        later = batch * (args.new_tokens - 1)
        de, dh = later / max(e - pe, 1e-9), later / max(h - ph, 1e-9)
        print(f"{batch:>5} {tokens / e:>13.1f} {tokens / h:>10.1f} {h / e:>6.2f}x   {pe:>11.2f} / {ph:<10.2f}"
              f" {de:>13.1f} / {dh:<11.1f} {de / dh if dh else float('nan'):>6.2f}x")  # fmt: skip
    if 1 in decode:
        # Batch-1 decode reads every weight once per token (the KV read is small beside it).
        bound = bandwidth / engine["weights_gb"]
        e1 = args.new_tokens / decode[1]["engine"]
        print(f"batch-1 bound: {bound:.1f} tok/s ({engine['weights_gb']:.2f} GB of weights / {bandwidth:.1f} GB/s); "
              f"engine at {e1 / bound:.0%} of it (includes prefill of the prompt)")  # fmt: skip
    if long:
        versus = f", one transformers forward {long['hf']:.1f} s ({long['engine'] / long['hf']:.2f}x)" if hf else ""
        print(f"prefill of {args.long_prompt} tokens: engine {long['engine']:.1f} s{versus}")
    if turns:
        per_turn = "; ".join(f"{s:.2f} s, {hit}/{n} cached" for s, n, hit in turns)
        rate = sum(hit for _, _, hit in turns[1:]) / sum(n for _, n, _ in turns[1:])
        print(f"4-turn episode ({args.first_turn} + {args.turn_tokens}/turn tokens), engine per turn: {per_turn}; "
              f"prefix-cache hit rate of turns 2-4 {rate:.1%}")  # fmt: skip
    after_decode = f"after decode rows {engine['rss_decode_gb']:.2f} GB; " if decode else ""
    print(f"peak RSS: engine {engine['rss_gb']:.2f} GB (after load {engine['rss_start_gb']:.2f} GB; {after_decode}"
          f"weights {engine['weights_gb']:.2f} GB + KV used {engine['kv_used_gb']:.2f} GB, "
          f"pool {engine['kv_pool_gb']:.2f} GB)" + (f"; transformers {hf['rss_gb']:.2f} GB" if hf else ""))  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
