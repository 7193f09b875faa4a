#!/usr/bin/env python
"""Benchmark: the real models' GRPO step planned across TPU generations, slice sizes
and H100 hosts, and the plan's method checked against this CPU's measured step.

Each row is one `legorl plan` run (a subprocess, as a user runs it) of the shipped
config on a slice, compiling the programs that price a step: the micro-step at the
longest length bucket (plain rows: prefix sharing's tree rows are left out to keep
the compiles few; `legorl plan` on the config itself compiles them too) and the
optimizer update. Rows go to `--out` as each finishes, so an interrupted run keeps
what it had; a row that exists is not planned again unless it failed or `--again`.

    .venv/bin/python scripts/bench_learner_hardware.py [--models qwen3-8b ...] [--slices v5p-64 ...]
    .venv/bin/python scripts/bench_learner_hardware.py --cpu-check

`--cpu-check` is the method against a measurement: this CPU's matmul rate and
memory bandwidth are measured, a small Qwen3's step is planned for this CPU by the
same code (`plan_learner`) and then run for real, and the estimate and the measured
step time are printed side by side (JSON to `--cpu-out`).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

MODELS = {
    "qwen3-8b": ("configs/qwen3_8b_v5p.yaml", "configs/hf/qwen3-8b.json"),
    "qwen3-30b-a3b": ("configs/qwen3_30b_a3b.yaml", "configs/hf/qwen3-30b-a3b.json"),
}
# Two sizes per generation around the real configs' v5p-64 (32 chips; v4 and v5p
# names count TensorCores, v5e, v6e and GPU names chips), and H100 hosts of 8 GPUs.
SLICES = ["v5p-64", "v5p-128", "v4-64", "v4-128", "v5e-32", "v5e-64", "v6e-32", "v6e-64", "h100-32", "h100-64"]
STEP_ONLY = ["--set", "learner.share_prefixes=false"]
HEADER = """# Learner hardware: the GRPO step planned across accelerators

Written by `scripts/bench_learner_hardware.py` (rerun it to refresh; rows are
written as each plan finishes). Each row is `legorl plan` of the shipped config
(`configs/qwen3_8b_v5p.yaml`, `configs/qwen3_30b_a3b.yaml`, models from
`configs/hf/`) on the named slice, compiled on a CPU machine: TPU programs by
libtpu, H100 programs by jax's CUDA plugin without a GPU. Only the longest length
bucket's plain rows and the optimizer update are compiled (every bucket's
micro-batch holds the same tokens; tree rows would add their own row). A slice
whose data-parallel shards outnumber the config's micro-batch rows gets a
micro-batch of one row per shard (the tokens per step stay the config's).

How to read it: HBM is the compiler's peak per chip (arguments, outputs,
temporaries, code, plus the optimizer state the micro-step keeps resident). Step
time is the roofline: the longest of the step's FLOPs (6 per active parameter per
token plus attention, 4/3 of it again with full remat) at the published bf16
peak, its HBM bytes (XLA's, which count a scanned layer once: a lower bound) at
the published bandwidth, and its collectives' bytes (fsdp gathers and gradient
reduce-scatters, tensor-parallel all-reduces; not MoE's token exchange) at half
the published bidirectional link bandwidth per chip. "limit" names the longest.
A best case: real steps add kernel inefficiency and imperfect overlap (see the
CPU check in `docs/benchmarks.md`, `--cpu-check`, for how far a measured step sits from its estimate).

GPU columns: XLA compiles for an H100 without one, given the GPU's description
(`legorl_jax/train/gpu_target.py`); it then reports memory but no cost
analysis, so the HBM-bandwidth bound is missing for those rows, and attention is
compiled blockwise (cuDNN's fused kernel needs the cuDNN library at compile
time). Across hosts the links are 400 Gb/s NICs per GPU, not NVLink.

A "no" is the shipped config (made for v5p) on that slice, not the slice's limit:
Qwen3-30B-A3B's 131,072-token micro-batches and 8-way expert sharding do not fit
32 GiB or 16 GiB chips as they are; a smaller micro-batch or a wider mesh might
(`legorl plan` names what dominates the peak and what would shrink it).

MoE on GPU does not fit, and the table says why: XLA's GPU compiler (jax 0.10.2)
lowers `jax.lax.ragged_dot`, the learner's grouped expert product, densely: one
product per expert for every routed token, so its temporaries are tokens × experts
× width. Compiled alone for one H100 (4,096 tokens, 64 experts, 256 → 256, bf16)
it plans 142.6 MB of temporaries against the dense product's 134.2 MB; for a v5p
chip the same program plans 0.16 MB. Qwen3-30B-A3B's 128 experts make that hundreds
of GiB per GPU; a GPU learner for MoE needs a grouped-GEMM kernel in its place.

"""
COLUMNS = ["model", "slice", "chips", "mesh", "HBM peak / chip (GiB)", "capacity (GiB)", "fits", "step (s)",
           "tokens/s/chip", "MFU", "limit", "compile (s)"]  # fmt: skip
HEADER += f"| {' | '.join(COLUMNS)} |\n|{' --- |' * len(COLUMNS)}\n"


def micro_batch_tokens(config: str, slice_name: str) -> int:
    """The config's micro-batch, or more where the slice's data-parallel shards need a row each:
    a wider fsdp on a bigger slice holds no fewer rows (the plan refuses a budget that cannot)."""
    from legorl_jax.core.config import load_config
    from legorl_jax.train.chips import parse_topology

    cfg = load_config(REPO / config)
    mesh = cfg.learner.mesh
    shards = parse_topology(slice_name).chips // (mesh.tensor * mesh.expert)
    return max(cfg.learner.micro_batch_tokens, shards * max(cfg.learner.length_buckets))


def plan_row(name: str, slice_name: str, tmp: Path) -> str:
    config, hf = MODELS[name]
    out = tmp / f"{name}-{slice_name}.json"
    budget = f"learner.micro_batch_tokens={micro_batch_tokens(config, slice_name)}"
    cmd = [sys.executable, "-m", "legorl_jax.cli", "plan", "--config", config, "--topology", slice_name,
           "--model-config", hf, "--json", str(out), *STEP_ONLY, "--set", budget]  # fmt: skip
    began = time.monotonic()
    run = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    took = time.monotonic() - began
    if run.returncode not in (0, 1) or not out.exists():
        reason = (run.stderr.strip().splitlines() or ["no output"])[-1][:160].replace("|", "/")
        return f"| {name} | {slice_name} | | | plan failed: {reason} | | | | | | | {took:.0f} |"
    s = json.loads(out.read_text())
    per_chip = s["devices"] // s["chips"]
    peak, cap = (per_chip * s[k] / 2**30 for k in ("hbm_peak_bytes_per_device", "hbm_capacity_bytes_per_device"))
    mesh = "×".join(f"{k}{v}" for k, v in s["mesh"].items() if v > 1) or "1"
    return (
        f"| {name} | {slice_name} | {s['chips']} | {mesh} | {peak:.1f} | {cap:.0f} | "
        f"{'yes' if s['fits'] else '**no**'} | {s['estimated_step_s']:.1f} | {s['tokens_per_s_per_chip']:,.0f} | "
        f"{s['estimated_mfu']:.0%} | {s['limit']} | {took:.0f} |"
    )


def compare(args: argparse.Namespace) -> None:
    if args.again or not args.out.exists():
        args.out.write_text(HEADER)
    rows = _rows(args.out.read_text())
    tmp = REPO / ".cache" / "plans"
    tmp.mkdir(parents=True, exist_ok=True)
    for name in args.models:
        for slice_name in args.slices:
            if "plan failed" not in rows.get((name, slice_name), "plan failed"):
                continue  # planned already; a failed plan is tried again
            print(f"planning {name} on {slice_name}", flush=True)
            row = plan_row(name, slice_name, tmp)
            print(row, flush=True)
            # Read again: another run of this script may have written rows meanwhile.
            rows = {**_rows(args.out.read_text()), (name, slice_name): row}
            args.out.write_text(HEADER + "".join(row + "\n" for _, row in sorted(rows.items(), key=_order)))


def _rows(text: str) -> dict[tuple[str, str], str]:
    """The table's rows by (model, slice)."""
    cells = (
        line.split(" | ") for line in text.splitlines() if line.startswith("| ") and line[2:].split(" | ")[0] in MODELS
    )
    return {(c[0][2:], c[1]): " | ".join(c) for c in cells}


def _order(item: tuple[tuple[str, str], str]) -> tuple[int, int]:
    (name, slice_name), _ = item
    return list(MODELS).index(name), SLICES.index(slice_name) if slice_name in SLICES else len(SLICES)


def cpu_check(args: argparse.Namespace) -> dict:
    """The plan's estimate of a step on this CPU against the step measured here."""
    from legorl_jax.train.plan import use_compiler

    use_compiler("cpu")
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from legorl_jax.core.config import DEFAULT_CONFIG, load_config
    from legorl_jax.models import CausalLM
    from legorl_jax.models.config import from_hf_config
    from legorl_jax.rl.batching import TrainSequence
    from legorl_jax.train.chips import Chip, Topology
    from legorl_jax.train.plan import plan_learner
    from legorl_jax.train.sharding import learner_mesh
    from legorl_jax.train.step import Learner

    seq_len, sequences = args.seq_len, 8
    hf = {"model_type": "qwen3", "vocab_size": 8192, "hidden_size": 512, "intermediate_size": 1536,
          "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64,
          "max_position_embeddings": seq_len, "tie_word_embeddings": True}  # fmt: skip
    cfg = load_config(None, [f"learner.length_buckets=[{seq_len}]", f"learner.micro_batch_tokens={4 * seq_len}",
                             "learner.share_prefixes=false", "rl.groups_per_step=2", "rl.group_size=4"],
                      default=DEFAULT_CONFIG)  # fmt: skip

    def best(fn, repeats: int = 3) -> float:
        jax.block_until_ready(fn())
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            jax.block_until_ready(fn())
            times.append(time.perf_counter() - start)
        return min(times)

    # The peaks this machine reaches: a large matmul in the config's compute dtype, and a
    # streaming add over an array far past the caches (read and written once).
    n = 2048
    a = jnp.ones((n, n), cfg.model.compute_dtype)
    matmul = jax.jit(lambda x: x @ x)
    flops = 2 * n**3 / best(lambda: matmul(a))
    big = jnp.ones((64 * 2**20,), jnp.float32)  # 256 MiB
    add = jax.jit(lambda x: x + 1.0)
    bandwidth = 2 * big.nbytes / best(lambda: add(big))
    chip = Chip("cpu", flops, 16 * 2**30, bandwidth, 1, 1, link_bandwidth=1e12, platform="cpu")
    plan = plan_learner(cfg, hf, Topology(chip, (1,)), progress=print)

    model_config = from_hf_config(hf, param_dtype=cfg.model.param_dtype, compute_dtype=cfg.model.compute_dtype,
                                  remat=cfg.model.remat, attention_kernel=cfg.model.attention_kernel)  # fmt: skip
    model = CausalLM(model_config, rngs=nnx.Rngs(0))
    learner = Learner(model, cfg.rl, cfg.learner, learner_mesh(cfg.learner.mesh, jax.devices("cpu")[:1]))
    rng = np.random.default_rng(0)
    mask = np.arange(seq_len) >= seq_len // 4
    seqs = [
        TrainSequence(
            rng.integers(0, hf["vocab_size"], seq_len).astype(np.int32),
            mask,
            np.where(mask, -9.0, 0.0).astype(np.float32),
            float(i % 2 * 2 - 1),
        )  # fmt: skip
        for i in range(sequences)
    ]
    measured = best(lambda: learner.train_step(learner.pack(seqs)))
    summary = plan.summary()
    report = {
        "cpu_matmul_flops": flops,
        "cpu_memory_bandwidth": bandwidth,
        "model_params": sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param))),
        "tokens_per_step": summary["tokens_per_step"],
        "estimated_step_s": summary["estimated_step_s"],
        "bound_s": summary["bound_s"],
        "limit": summary["limit"],
        "measured_step_s": measured,
        "measured_over_estimate": measured / summary["estimated_step_s"],
        "estimated_mfu": summary["estimated_mfu"],
        "measured_mfu": summary["model_flops_per_step"] / (flops * measured),
    }
    print(json.dumps(report, indent=2))
    if args.cpu_out:
        args.cpu_out.write_text(json.dumps(report, indent=2) + "\n")
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=list(MODELS))
    parser.add_argument("--slices", nargs="+", default=SLICES)
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "learner_hardware.md")
    parser.add_argument("--again", action="store_true", help="start the table anew instead of adding missing rows")
    parser.add_argument("--cpu-check", action="store_true", help="the method against this CPU's measured step")
    parser.add_argument("--seq-len", type=int, default=1024, help="--cpu-check: the step's row length")
    parser.add_argument("--cpu-out", type=Path, help="--cpu-check: also write the report as JSON here")
    args = parser.parse_args()
    if args.cpu_check:
        cpu_check(args)
    else:
        compare(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
