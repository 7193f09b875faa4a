#!/usr/bin/env python
"""Benchmark: the embedded JAX engine against `transformers` (torch, CPU) and,
opt-in (`--sides engine hf vllm`), vLLM's CPU build, on the same random weights
at a real model's shape, in one run.

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

vLLM (`--sides ... vllm`; off by default: it starts in minutes here, compiling
its model with torch.compile at every start) runs as the project launches it,
`rollout_server.backends.launch.start_engine` (its CPU build's KV pool 2 GiB
unless `--kv-cache-gb`; context the larger of 4,096 and the longest row), on an
ephemeral port, driven over HTTP by token ids: the same prompts, all of a row
submitted at once, greedy, EOS ignored, prefix cache reset before every run
(`/reset_prefix_cache`), the untimed run the row itself. Its times include the
HTTP round trips (small beside seconds of generation); the engine's are in-process.
`--vllm-dtype` (float32, as the other sides; vLLM's own choice for a float32
checkpoint on CPU is bfloat16) and `--vllm-cpus` (auto: vLLM's own binding,
which on 2 cores computes on one and reserves the other for its scheduler; or
a core list for VLLM_CPU_OMP_THREADS_BIND, e.g. 0-1). Its resident memory is
the sum of each of its processes' peaks (API server, engine core, worker).
The 4-turn episode is the engine's alone.

The engine worker runs with the malloc settings `legorl` itself applies
(`legorl_jax.core.allocator`; `--engine-malloc default` keeps glibc's), the
transformers worker with glibc's defaults, as a user running transformers has
them (`--hf-malloc tuned` gives it the engine's).

`--num-layers` overrides the shape's depth: a row too slow at full depth runs
at fewer layers, and its ratio is then per layer (the LM head is not).

    .venv/bin/python scripts/bench_engine.py --shape smollm2-135m [--batches 1 8 32] [--long-prompt 32768]
    .venv/bin/python scripts/bench_engine.py --sides engine hf vllm --batches 1 8 --long-prompt 1024 --first-turn 0
"""

from __future__ import annotations

import argparse
import asyncio
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


def group_peak_rss_gb(pgid: int) -> float:
    """The sum of the peak resident memory (VmHWM) of every process in a group:
    a bound on the group's peak (each process may peak at another time)."""
    total_kib = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if os.getpgid(int(entry.name)) != pgid:
                continue
            status = (entry / "status").read_text()
        except (OSError, ProcessLookupError):
            continue  # gone meanwhile
        total_kib += next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM:")), 0)
    return total_kib / 2**20


class VllmSide:
    """vLLM's CPU build launched as the project launches it (`start_engine`), over
    HTTP with token-id prompts; greedy, EOS ignored, prefix cache reset per run."""

    def __init__(self, args: argparse.Namespace, model_dir: Path) -> None:
        from legorl_jax.core.config import EngineConfig
        from rollout_server.backends.launch import start_engine
        from rollout_server.backends.vllm import check_vllm_version

        self.args = args
        self.vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
        if args.vllm_cpus != "auto":
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = args.vllm_cpus  # the engine process inherits it
        config = EngineConfig(
            kind="vllm",
            port=0,  # an ephemeral port (start_engine's free_port)
            max_batch=max([32, *args.batches]),
            max_context=max(4096, args.prompt_tokens + args.new_tokens, args.long_prompt + 1),
            dtype=args.vllm_dtype,
            kv_cache_memory_bytes=int(args.kv_cache_gb * 1e9) if args.kv_cache_gb else None,
        )
        self.version = str(check_vllm_version())
        self.log = Path(tempfile.mkdtemp(prefix="bench-engine-vllm-")) / "vllm.log"
        progress("vllm", f"starting vLLM {self.version} (log {self.log})")
        start = time.perf_counter()
        self.engine = start_engine(config, model_dir, log_path=self.log)
        self.start_s = time.perf_counter() - start
        progress("vllm", f"up in {self.start_s:.0f} s at {self.engine.url}")
        self.client = self.engine.sync_client()
        self.rss_decode_gb = 0.0

    def _rss_gb(self) -> float:
        pid = self.engine.supervisor.pid if self.engine.supervisor is not None else None
        return group_peak_rss_gb(pid) if pid is not None else float("nan")

    def _generate(self, prompts: list[list[int]], new_tokens: int) -> float:
        """Seconds to generate new_tokens for every prompt, all sent at once, after a prefix-cache reset."""

        async def run() -> float:
            client = self.client.async_client
            await client.reset_prefix_cache()
            start = time.perf_counter()
            answers = await asyncio.gather(
                *(client.complete(p, max_tokens=new_tokens, temperature=0.0, ignore_eos=True) for p in prompts)
            )
            seconds = time.perf_counter() - start
            counts = {len(choices[0].token_ids) for choices in answers}
            if counts != {new_tokens}:
                raise RuntimeError(f"vLLM generated {counts} tokens per request, not {new_tokens}")
            return seconds

        return self.client.run(run())

    def warm(self, op: str, *args: Any) -> None:
        getattr(self, op)(*args)

    def decode(self, batch: int, new_tokens: int | None = None) -> float:
        prompts = prompts_for(batch, self.args.prompt_tokens, self.vocab, batch)
        seconds = self._generate(prompts, new_tokens or self.args.new_tokens)
        self.rss_decode_gb = max(self.rss_decode_gb, self._rss_gb())
        return seconds

    def prefill(self, batch: int) -> float:
        """The decode row's prompts to their first token."""
        return self.decode(batch, 1)

    def long(self) -> float:
        return self._generate(prompts_for(1, self.args.long_prompt, self.vocab, 99), 1)

    def finish(self) -> dict[str, Any]:
        rss = self._rss_gb()
        self.client.close()
        self.engine.stop()
        return {"rss_gb": rss, "start_s": self.start_s, "version": self.version}


SIDES = {"engine": EngineSide, "hf": HFSide, "vllm": VllmSide}
LABELS = {"engine": "engine", "hf": "transformers", "vllm": "vLLM"}


def serve_worker(args: argparse.Namespace) -> int:
    """A worker's loop: one JSON request per stdin line ({"op": ..., "arg": ...}),
    one marked JSON answer per request on stdout; "finish" ends it."""
    side = SIDES[args.side](args, args.model_dir)
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
            try:
                self.proc.stdin.write(json.dumps({"op": op, "args": list(args)}) + "\n")
                self.proc.stdin.flush()
            except BrokenPipeError:  # it died since its last answer (-9: killed, e.g. out of memory)
                raise RuntimeError(f"the {self.side} worker exited (status {self.proc.wait()}) before {op!r}") from None
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
    parser.add_argument(
        "--sides",
        nargs="+",
        choices=sorted(SIDES),
        default=["engine", "hf"],
        help="sides to run, engine first and always (the baseline of every ratio); vllm is opt-in: "
        "vLLM's CPU build, started through start_engine in minutes here",
    )
    parser.add_argument("--engine-only", action="store_true", help="no other side (--sides engine)")
    parser.add_argument(
        "--vllm-dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="vLLM's --dtype (float32: as the other sides; vLLM's own choice on CPU is bfloat16)",
    )
    parser.add_argument(
        "--vllm-cpus",
        default="auto",
        help="vLLM's VLLM_CPU_OMP_THREADS_BIND: auto (its own; on 2 cores one computes, one is reserved "
        "for its scheduler) or a core list such as 0-1",
    )
    parser.add_argument("--first-turn", type=int, default=10000, help="first prompt of the 4-turn episode; 0 skips")
    parser.add_argument("--turn-tokens", type=int, default=500, help="tokens each later turn adds")
    parser.add_argument(
        "--kv-cache-gb",
        type=float,
        help="the engine's KV pool, and vLLM's (default: each one's own, which may queue the largest batch; "
        "vLLM's CPU build: 2 GiB, start_engine's)",
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
    parser.add_argument("--side", choices=sorted(SIDES), help=argparse.SUPPRESS)
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
    if args.engine_only:
        args.sides = ["engine"]
    if "engine" not in args.sides:
        parser.error("--sides must include engine: it is the baseline of every ratio")
    args.sides = ["engine"] + [s for s in dict.fromkeys(args.sides) if s != "engine"]
    args.episode_tokens = args.first_turn + 4 * (args.turn_tokens + 1) if args.first_turn else 0
    if args.side:
        return serve_worker(args)

    from legorl_jax.models.demo_assets import build_tiny_hf_model

    shape = SHAPES[args.shape] | ({"num_layers": args.num_layers} if args.num_layers else {})
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_hf_model(Path(tmp) / args.shape, **shape)
        malloc = {"engine": args.engine_malloc, "hf": args.hf_malloc, "vllm": "default"}
        workers = [Worker(side, model_dir, os.environ | {"LEGORL_MALLOC": malloc[side]}) for side in args.sides]
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
    finished = {worker.side: worker.ask("finish") for worker in workers}
    engine, hf, vllm = finished["engine"], finished.get("hf"), finished.get("vllm")
    sides = [worker.side for worker in workers]
    others = sides[1:]  # every ratio is the engine's against one of these
    lengths = f"prompt {args.prompt_tokens}, new {args.new_tokens} tokens; " if decode else ""
    print(f"shape {args.shape} {shape}; {lengths}"
          f"median of {args.repeats} timed run(s) per side; memory bandwidth {bandwidth:.1f} GB/s"
          + f"; malloc: engine {args.engine_malloc}"
          + (f", transformers {args.hf_malloc}; torch threads {hf['threads']}" if hf else "")
          + (f"; vLLM {vllm['version']} {args.vllm_dtype}, cpus {args.vllm_cpus}, up in {vllm['start_s']:.0f} s"
             if vllm else ""))  # fmt: skip
    if decode:
        names = " / ".join(sides)
        print(f"{'batch':>5}" + "".join(f" {side + ' tok/s':>12}" for side in sides)
              + "".join(f" {'x ' + side:>8}" for side in others)
              + f"   prefill s ({names})   decode tok/s ({names})"
              + "".join(f" {'x ' + side:>8}" for side in others))  # fmt: skip
    for batch, seconds in decode.items():
        tokens = batch * args.new_tokens
        # Decode alone: the tokens after the first, over the row's time less its prefill
        # (nan where the prefill alone took longer than the row: load that came and went).
        later = batch * (args.new_tokens - 1)
        rate = {side: later / (t - prefill[batch][side]) if t > prefill[batch][side] else float("nan")
                for side, t in seconds.items()}  # fmt: skip
        print(f"{batch:>5}" + "".join(f" {tokens / t:>12.1f}" for t in seconds.values())
              + "".join(f" {seconds[o] / seconds['engine']:>7.2f}x" for o in others)
              + "   " + " / ".join(f"{t:.2f}" for t in prefill[batch].values())
              + "   " + " / ".join(f"{r:.1f}" for r in rate.values())
              + "".join(f" {rate['engine'] / rate[o]:>7.2f}x" for o in others))  # fmt: skip
    if 1 in decode:
        # Batch-1 decode reads every weight once per token (the KV read is small beside it).
        bound = bandwidth / engine["weights_gb"]
        e1 = args.new_tokens / decode[1]["engine"]
        print(f"batch-1 bound: {bound:.1f} tok/s ({engine['weights_gb']:.2f} GB of weights / {bandwidth:.1f} GB/s); "
              f"engine at {e1 / bound:.0%} of it (includes prefill of the prompt)")  # fmt: skip
    if long:
        what = {"hf": "one transformers forward", "vllm": "vLLM (1 token)"}
        versus = "".join(f", {what[o]} {long[o]:.1f} s ({long['engine'] / long[o]:.2f}x)" for o in others)
        print(f"prefill of {args.long_prompt} tokens: engine {long['engine']:.1f} s{versus}")
    if turns:
        per_turn = "; ".join(f"{s:.2f} s, {hit}/{n} cached" for s, n, hit in turns)
        rate = sum(hit for _, _, hit in turns[1:]) / sum(n for _, n, _ in turns[1:])
        print(f"4-turn episode ({args.first_turn} + {args.turn_tokens}/turn tokens), engine per turn: {per_turn}; "
              f"prefix-cache hit rate of turns 2-4 {rate:.1%}")  # fmt: skip
    after_decode = f"after decode rows {engine['rss_decode_gb']:.2f} GB; " if decode else ""
    print(f"peak RSS: engine {engine['rss_gb']:.2f} GB (after load {engine['rss_start_gb']:.2f} GB; {after_decode}"
          f"weights {engine['weights_gb']:.2f} GB + KV used {engine['kv_used_gb']:.2f} GB, "
          f"pool {engine['kv_pool_gb']:.2f} GB)" + (f"; transformers {hf['rss_gb']:.2f} GB" if hf else "")
          + (f"; vLLM {vllm['rss_gb']:.2f} GB (sum of its processes' peaks)" if vllm else ""))  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
