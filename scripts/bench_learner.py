#!/usr/bin/env python3
"""Learner benchmark: GRPO step time vs a plain forward+backward, and MFU.

Everything is measured in one process on one set of devices:
- the dense matmul rate of this machine in the compute dtype (the MFU peak);
- a plain forward+backward (mean token NLL through the same chunked logprobs)
  of the model on the packed batch — the baseline;
- the full GRPO step (`Learner.train_step`: packing, host→device, loss with
  TIS/MIS, gradient accumulation, clip + AdamW) on the same batch.

Model FLOPs follow PaLM's convention: 6·N per token for the matmul parameters
(including the LM head) plus 12·L·H·Dh·T for attention. A JSON report (hardware,
mesh, tokens/s, MFU, step-time split) goes to stdout and to --out.

    .venv/bin/python scripts/bench_learner.py --size 100m --seq-len 1024
    .venv/bin/python scripts/bench_learner.py --size small --dtype bfloat16 --out bench.json

`--shared-prefix` instead compares prefix-shared (tree) packing with unshared
packing of the same step in the same run: groups of 8 with a 16k-token prompt
and 1k-token continuations, and a mixed step (4 harness configurations × 4
tasks × 8 members: a 12k system prefix, 500 tokens of task text, 1k
continuations). Step time, peak memory of the compiled micro-step and the loss
of each; `--scale N` divides every length by N for machines where the full
size would take too long.

    .venv/bin/python scripts/bench_learner.py --shared-prefix --scale 16
    .venv/bin/python scripts/bench_learner.py --shared-prefix --cases groups_of_8 --remat full --repeats 1 --no-warmup

`--small-step` compares micro-batches sized by the step's rows with the fixed
shape of the budget's full row count (`fit_rows=False`, the layout before) on a
small step: `--small-seqs` sequences of `--small-len` tokens at
`--micro-batch-tokens` with the default length buckets. Step time, peak memory
of the compiled micro-step and the loss of each, same model, same run.

    .venv/bin/python scripts/bench_learner.py --small-step --size small

`--lora RANK` compares a learner training rank-RANK adapters on every attention and
MLP projection (base frozen) with full fine-tuning of the same model on the same
step: step time, peak memory of the compiled micro-step, and the state each keeps
resident between steps (parameters, frozen base, optimizer moments).

    .venv/bin/python scripts/bench_learner.py --lora 16 --size 100m
    .venv/bin/python scripts/bench_learner.py --lora 16 --size qwen3-0.6b --seq-len 512
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from legorl_jax.core.config import LearnerConfig, MeshConfig, RLConfig
from legorl_jax.models import CausalLM, ModelConfig, batch_sharding, token_logprobs
from legorl_jax.rl.batching import PackedStep, TrainSequence
from legorl_jax.train.sharding import learner_mesh, put_batch
from legorl_jax.train.step import Learner

SIZES: dict[str, dict[str, Any]] = {
    # ~101M parameters (25M of them the tied embedding), Qwen3 layout.
    "100m": dict(
        vocab_size=32768,
        hidden_size=768,
        intermediate_size=2048,
        num_layers=12,
        num_heads=12,
        num_kv_heads=4,
        head_dim=64,
    ),
    # Qwen3-0.6B's shape (~596M parameters, 156M of them the tied embedding).
    "qwen3-0.6b": dict(
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_layers=28,
        num_heads=16,
        num_kv_heads=8,
        head_dim=128,
    ),
    # ~7M parameters: for slow or shared CPUs.
    "small": dict(
        vocab_size=8192, hidden_size=256, intermediate_size=768, num_layers=6, num_heads=4, num_kv_heads=2, head_dim=64
    ),
}


def interleaved(fns: dict[str, Callable[[], Any]], repeats: int, warmup: bool = True) -> dict[str, float]:
    """Best wall seconds of each function over `repeats` rounds, after one warm-up
    (compilation) call each unless `warmup` is off. Rounds interleave the functions
    so that load from other processes on a shared machine hits all of them alike."""
    for fn in fns.values() if warmup else ():
        jax.block_until_ready(fn())
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            jax.block_until_ready(fn())
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def matmul(dtype: str, n: int) -> Callable[[], jax.Array]:
    """An n×n×n matmul in `dtype` (2·n³ FLOPs): the machine's peak reference."""
    key = jax.random.key(0)
    a = jax.random.normal(key, (n, n), dtype)
    b = jax.random.normal(jax.random.fold_in(key, 1), (n, n), dtype)
    f = jax.jit(lambda x, y: x @ y)
    return lambda: f(a, b)


def model_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    d, layers = cfg.hidden_size, cfg.num_layers
    attn = d * cfg.head_dim * (2 * cfg.num_heads + 2 * cfg.num_kv_heads)
    mlp = 3 * d * cfg.intermediate_size
    matmul_params = layers * (attn + mlp) + cfg.vocab_size * d
    return 6 * matmul_params + 12 * layers * cfg.num_heads * cfg.head_dim * seq_len


def synthetic_step(rows: int, seq_len: int, vocab: int, per_row: int, seed: int = 0) -> list[TrainSequence]:
    """Rows filled exactly by `per_row` sequences each: a quarter prompt, the rest sampled."""
    rng = np.random.default_rng(seed)
    length = seq_len // per_row
    seqs = []
    for i in range(rows * per_row):
        mask = np.arange(length) >= length // 4
        behav = np.where(mask, -np.log(vocab) + rng.normal(0, 0.1, length), 0.0).astype(np.float32)
        seqs.append(TrainSequence(rng.integers(0, vocab, length).astype(np.int32), mask, behav, float(i % 2 * 2 - 1)))
    return seqs


def prefix_groups(
    configs: int, tasks: int, members: int, system: int, task: int, continuation: int, vocab: int, seed: int = 0
) -> list[TrainSequence]:
    """Sequences of `configs` harness configurations (a shared system prefix) × `tasks`
    (a shared task text) × `members`, each member with its own sampled continuation."""
    rng = np.random.default_rng(seed)
    seqs = []
    for _ in range(configs):
        prefix = rng.integers(0, vocab, system)
        for _ in range(tasks):
            prompt = np.concatenate([prefix, rng.integers(0, vocab, task)])
            for m in range(members):
                tokens = np.concatenate([prompt, rng.integers(0, vocab, continuation)]).astype(np.int32)
                mask = np.arange(len(tokens)) >= len(prompt)
                behav = np.where(mask, -np.log(vocab) + rng.normal(0, 0.1, len(tokens)), 0.0).astype(np.float32)
                seqs.append(TrainSequence(tokens, mask, behav, float(m % 2 * 2 - 1)))
    return seqs


SHARED_CASES = {
    "groups_of_8": dict(configs=1, tasks=1, members=8, system=16384, task=0, continuation=1024),
    "mixed": dict(configs=4, tasks=4, members=8, system=12288, task=500, continuation=1024),
}


def micro_step_peak_bytes(learner: Learner, packed: Any) -> int:
    """Largest temporary + argument footprint XLA plans for the step's micro-step shapes."""
    coef = jnp.float32(0.0)
    peak = 0
    with jax.set_mesh(learner.mesh):
        for mb in {(mb.tokens.shape, mb.tree): mb for mb in packed.micro_batches}.values():
            lowered = learner._micro.lower(
                learner.params, learner.frozen, learner.ref_params, learner._zero_acc(), learner.device_batch(mb), coef
            )
            mem = lowered.compile().memory_analysis()
            if mem is None:
                raise SystemExit(f"{jax.default_backend()} reports no memory analysis of compiled programs")
            peak = max(peak, int(mem.temp_size_in_bytes + mem.argument_size_in_bytes))
    return peak


def build_model(args: argparse.Namespace) -> tuple[Any, ModelConfig, CausalLM, int]:
    """The benchmarked Qwen3 of `--size`, its mesh, config and parameter count."""
    mesh = learner_mesh(MeshConfig(fsdp=-1, tensor=args.tensor))
    cfg = ModelConfig(
        architecture="qwen3",
        qk_norm=True,
        tie_word_embeddings=True,
        param_dtype="float32",
        compute_dtype=args.dtype,
        remat=args.remat,
        **SIZES[args.size],
    )
    model = CausalLM(cfg, rngs=nnx.Rngs(0))
    n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    return mesh, cfg, model, int(n_params)


def run_shared_prefix(args: argparse.Namespace) -> dict[str, Any]:
    """Tree packing against unshared packing of the same steps, same model, same run."""
    mesh, cfg, model, n_params = build_model(args)
    report: dict[str, Any] = {
        "model": {"size": args.size, "params": int(n_params), "dtype": args.dtype, "remat": args.remat},
        "scale": args.scale,
        "platform": jax.devices()[0].platform,
        "host_cpus": os.cpu_count(),
        "cases": {},
    }
    for name in args.cases:
        report["cases"][name] = shared_prefix_case(args, name, model, cfg, mesh)
    return report


def shared_prefix_case(args: argparse.Namespace, name: str, model: CausalLM, cfg: ModelConfig, mesh: Any) -> dict:
    """One case of `run_shared_prefix`; its learners are freed on return."""
    lengths = {
        k: v if k in ("configs", "tasks", "members") else -(-v // args.scale) for k, v in SHARED_CASES[name].items()
    }
    seqs = prefix_groups(**lengths, vocab=cfg.vocab_size)
    # Rows up to twice a sequence: a group's tree (or a part of it, each with the prefix) fits one row;
    # one row of the largest bucket per micro-batch bounds memory alike for both packings.
    unit = -(-len(seqs[0].token_ids) // 128) * 128
    buckets = sorted({unit * k // 4 // 128 * 128 for k in range(4, 9)})
    learners, packed = {}, {}
    for share in (True, False):
        lc = LearnerConfig(
            micro_batch_tokens=buckets[-1], length_buckets=buckets, logprob_chunk_size=args.chunk, share_prefixes=share
        )
        kind = "tree" if share else "unshared"
        learners[kind] = Learner(model, RLConfig(), lc, mesh)
        packed[kind] = learners[kind].pack(seqs)
    results = compare(learners, packed, args.repeats, warmup=not args.no_warmup)
    return {"lengths": lengths, "sequences": len(seqs), "buckets": buckets, **results}


def compare(
    learners: dict[str, Learner], packed: dict[str, PackedStep], repeats: int, warmup: bool = True
) -> dict[str, Any]:
    """Two packings of one step, the measured one first and its baseline second ("tree",
    "unshared" or "fitted", "full"), each trained by its own learner of the same model:
    step time, first-step loss, tokens and peak memory of each."""
    losses: dict[str, list[float]] = {k: [] for k in learners}

    def step(kind: str) -> None:
        losses[kind].append(learners[kind].train_step(packed[kind])["loss"])

    # Compiled before timing: without a warm-up step the timed step reads these programs
    # from the persistent compilation cache `main` sets up for --no-warmup.
    peaks = {k: micro_step_peak_bytes(learners[k], packed[k]) / 2**20 for k in learners}
    t = interleaved({k: partial(step, k) for k in learners}, repeats, warmup)
    new, old = learners  # the packing measured, then its baseline
    return {
        **{
            k: {
                "step_s": t[k],
                "loss_first_step": losses[k][0],
                "computed_tokens": packed[k].stats["batch/computed_tokens"],
                "represented_tokens": packed[k].stats["batch/tokens"],
                "shared_token_frac": packed[k].stats["batch/shared_token_frac"],
                "padded_tokens": sum(mb.tokens.size for mb in packed[k].micro_batches),
                "shapes": [list(mb.tokens.shape) for mb in packed[k].micro_batches],
                "micro_batches": len(packed[k].micro_batches),
                "micro_step_peak_mib": peaks[k],
            }
            for k in learners
        },
        f"{new}_over_{old}_time": t[new] / t[old],
        "loss_rel_diff": abs(losses[new][0] - losses[old][0]) / abs(losses[old][0]),
    }


def run_small_step(args: argparse.Namespace) -> dict[str, Any]:
    """A small step at a large budget: micro-batches sized by its rows against the fixed full-row shape."""
    mesh, cfg, model, n_params = build_model(args)
    seqs = synthetic_step(1, args.small_seqs * args.small_len, cfg.vocab_size, args.small_seqs)
    lc = LearnerConfig(micro_batch_tokens=args.micro_batch_tokens, logprob_chunk_size=args.chunk)
    learners = {"fitted": Learner(model, RLConfig(), lc, mesh), "full": Learner(model, RLConfig(), lc, mesh)}
    packed = {"fitted": learners["fitted"].pack(seqs), "full": learners["full"].pack(seqs, fit_rows=False)}
    return {
        "model": {"size": args.size, "params": n_params, "dtype": args.dtype, "remat": args.remat},
        "platform": jax.devices()[0].platform,
        "host_cpus": os.cpu_count(),
        "sequences": len(seqs),
        "sequence_tokens": args.small_len,
        "micro_batch_tokens": args.micro_batch_tokens,
        "buckets": lc.length_buckets,
        **compare(learners, packed, args.repeats),
        "repeats": args.repeats,
        "load_average_1m": os.getloadavg()[0],
    }


def resident_mib(learner: Learner) -> float:
    """What a learner keeps on its devices between steps: trained parameters, frozen base,
    optimizer state (and the KL reference, when kept)."""
    trees = (learner.params, learner.frozen, learner.opt_state, learner.ref_params)
    return sum(x.nbytes for tree in trees for x in jax.tree.leaves(tree)) / 2**20


def run_lora(args: argparse.Namespace) -> dict[str, Any]:
    """LoRA adapters against full fine-tuning of one model on one step, in one process."""
    from legorl_jax.models.lora import TARGETS, add_adapters

    mesh, cfg, model, n_params = build_model(args)
    seqs = synthetic_step(args.rows, args.seq_len, cfg.vocab_size, args.per_row)
    lc = LearnerConfig(
        micro_batch_tokens=args.rows * args.seq_len, length_buckets=[args.seq_len], logprob_chunk_size=args.chunk
    )
    full = Learner(model, RLConfig(), lc, mesh)  # copies what it trains: the model stays the base
    add_adapters(model, rank=args.lora, alpha=2.0 * args.lora, targets=list(TARGETS), seed=0, mesh=mesh)
    learners = {"lora": Learner(model, RLConfig(), lc, mesh), "full": full}
    packed = {k: learner.pack(seqs) for k, learner in learners.items()}
    trained = {k: sum(x.size for x in jax.tree.leaves(learner.params)) for k, learner in learners.items()}
    resident = {k: resident_mib(learner) for k, learner in learners.items()}
    result = compare(learners, packed, args.repeats)
    for k in learners:
        result[k].update(trained_params=int(trained[k]), resident_mib=resident[k])
    return {
        "model": {"size": args.size, "params": n_params, "dtype": args.dtype, "remat": args.remat},
        "rank": args.lora,
        "platform": jax.devices()[0].platform,
        "host_cpus": os.cpu_count(),
        "tokens_per_step": args.rows * args.seq_len,
        **result,
        "repeats": args.repeats,
        "load_average_1m": os.getloadavg()[0],
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    mesh, cfg, model, n_params = build_model(args)
    tokens_per_step = args.rows * args.seq_len
    learner_cfg = LearnerConfig(
        micro_batch_tokens=tokens_per_step, length_buckets=[args.seq_len], logprob_chunk_size=args.chunk
    )
    learner = Learner(model, RLConfig(), learner_cfg, mesh)
    del model
    seqs = synthetic_step(args.rows, args.seq_len, cfg.vocab_size, args.per_row)
    packed = learner.pack(seqs)
    assert len(packed.micro_batches) == 1, "benchmark expects one micro-batch per step"

    # Baseline: the same model, batch, shardings and chunked logprobs; loss = mean NLL.
    mb = packed.micro_batches[0]
    batch = put_batch({"tokens": mb.tokens, "positions": mb.positions, "segment_ids": mb.segment_ids}, mesh)

    def nll(params: dict, b: dict) -> jax.Array:
        m = nnx.merge(learner.graphdef, params)
        lp = token_logprobs(
            m, b["tokens"], positions=b["positions"], segment_ids=b["segment_ids"], chunk_size=args.chunk
        )
        return -jnp.mean(lp)

    batch_sh = {k: batch_sharding(mesh) for k in batch}
    fwd_bwd = jax.jit(
        jax.value_and_grad(nll), in_shardings=(learner.param_sh, batch_sh), out_shardings=(None, learner.param_sh)
    )
    t = interleaved(
        {
            "matmul": matmul(args.dtype, args.matmul_n),
            "baseline": lambda: fwd_bwd(learner.params, batch),
            "grpo_step": lambda: learner.train_step(learner.pack(seqs)),
            "pack": lambda: learner.pack(seqs),
            "host_to_device": lambda: learner.device_batch(mb),
            "accumulate": lambda: learner.accumulate(packed)[0],
        },
        args.repeats,
    )
    peak = 2 * args.matmul_n**3 / t["matmul"]
    flops = model_flops_per_token(cfg, args.seq_len) * tokens_per_step
    step_s, base_s = t["grpo_step"], t["baseline"]
    return {
        "hardware": {
            "platform": jax.devices()[0].platform,
            "device_kind": jax.devices()[0].device_kind,
            "devices": jax.device_count(),
            "processes": jax.process_count(),
            "host_cpus": os.cpu_count(),
            "machine": platform.machine(),
            "jax": jax.__version__,
        },
        "mesh": dict(mesh.shape),
        "model": {"size": args.size, "params": int(n_params), "dtype": args.dtype, "remat": args.remat},
        "batch": {
            "rows": args.rows,
            "seq_len": args.seq_len,
            "tokens": tokens_per_step,
            "padding_frac": packed.stats["batch/padding_frac"],
        },
        "matmul_peak_tflops": peak / 1e12,
        "model_tflops_per_step": flops / 1e12,
        "baseline_fwd_bwd_s": base_s,
        "grpo_step_s": step_s,
        "grpo_over_baseline": step_s / base_s,
        "tokens_per_s": tokens_per_step / step_s,
        "mfu": flops / step_s / peak,
        "baseline_mfu": flops / base_s / peak,
        "split_s": {
            "pack": t["pack"],
            "host_to_device": t["host_to_device"],
            "accumulate": t["accumulate"],
            "update_and_rest": max(step_s - t["accumulate"] - t["pack"], 0.0),
        },
        "repeats": args.repeats,
        "timing": "best of the repeats, functions interleaved per round",
        "load_average_1m": os.getloadavg()[0],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="100m")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--rows", type=int, default=1, help="Packed rows per step (tokens = rows × seq-len).")
    parser.add_argument("--per-row", type=int, default=4, help="Sequences packed per row.")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--remat", choices=["none", "full", "dots_saveable"], default="none")
    parser.add_argument("--tensor", type=int, default=1, help="Tensor-parallel mesh axis; fsdp takes the rest.")
    parser.add_argument("--chunk", type=int, default=1024, help="Logprob chunk (tokens).")
    parser.add_argument("--matmul-n", type=int, default=2048, help="Matmul size for the peak measurement.")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="", help="Also write the JSON report here.")
    parser.add_argument("--shared-prefix", action="store_true", help="Tree packing vs unshared packing.")
    parser.add_argument("--scale", type=int, default=1, help="--shared-prefix: divide every length by this.")
    parser.add_argument("--cases", nargs="+", choices=sorted(SHARED_CASES), default=sorted(SHARED_CASES))
    parser.add_argument(
        "--no-warmup",
        action="store_true",
        help="--shared-prefix: time the first step (for steps of many minutes); its micro-steps are compiled "
        "ahead into a persistent compilation cache, so compiling stays out of the time.",
    )
    parser.add_argument("--lora", type=int, default=0, metavar="RANK", help="LoRA adapters vs full fine-tuning.")
    parser.add_argument("--small-step", action="store_true", help="Rows sized by the step vs the fixed full shape.")
    parser.add_argument("--small-seqs", type=int, default=4, help="--small-step: sequences in the step.")
    parser.add_argument("--small-len", type=int, default=400, help="--small-step: tokens per sequence.")
    parser.add_argument("--micro-batch-tokens", type=int, default=16384, help="--small-step: the budget.")
    args = parser.parse_args()
    if args.seq_len % args.per_row:
        parser.error("--seq-len must be a multiple of --per-row")
    if min(args.small_seqs, args.small_len - 1, args.micro_batch_tokens) < 1:
        parser.error("--small-seqs and --micro-batch-tokens must be positive, --small-len at least 2")
    if args.no_warmup:
        jax.config.update("jax_compilation_cache_dir", tempfile.mkdtemp(prefix="bench-learner-xla-"))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    if args.lora:
        report = run_lora(args)
    elif args.small_step:
        report = run_small_step(args)
    else:
        report = run_shared_prefix(args) if args.shared_prefix else run(args)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
