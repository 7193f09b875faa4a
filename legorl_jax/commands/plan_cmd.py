"""`legorl plan`: compile a run's learner for a TPU slice or GPU hosts on this machine
(no TPU or GPU needed) and say whether it fits the chips' memory, and how fast it would run.

legorl plan --config configs/qwen3_8b_v5p.yaml --topology v5p-64 [--model-config FILE] [--json OUT]

Exit status: 0 when the plan fits, 1 when it does not (its numbers and what would
make it fit are printed), 2 when it cannot be made (bad input, no libtpu).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from legorl_jax.commands import add_config_arguments, load_command_config
from legorl_jax.train.chips import GIB


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--topology",
        required=True,
        metavar="NAME",
        help="the TPU slice: v5p-64, v4-32 (TensorCores), v6e-64, v5e-16 (chips) or libtpu's v5p:4x4x2, v6e:8x8; "
        "or H100 GPUs: h100-8 (one host), h100-64 (eight)",
    )
    parser.add_argument(
        "--model-config",
        metavar="FILE",
        help="the model's HF config.json (default: config.json in model.path; configs/hf/ has Qwen3-8B's "
        "and Qwen3-30B-A3B's)",
    )
    parser.add_argument("--json", metavar="OUT", help="also write the plan as one JSON object to OUT ('-': stdout)")
    add_config_arguments(parser, demo_default=True)


def run(args: argparse.Namespace) -> int:
    from legorl_jax.train.chips import parse_topology
    from legorl_jax.train.plan import PlanError, use_compiler

    try:
        topology = parse_topology(args.topology)
    except ValueError as exc:
        print(f"legorl plan: --topology: {exc}", file=sys.stderr)
        return 2
    use_compiler(topology.platform)  # before anything imports jax
    cfg = load_command_config(args)
    source = args.model_config or cfg.model.path
    if source is None or (args.model_config is None and not Path(source).exists()):
        print(
            f"legorl plan: no model config to read (model.path={cfg.model.path!r} is not a local directory): "
            "pass --model-config FILE (an HF config.json)",
            file=sys.stderr,
        )
        return 2
    from legorl_jax.models import UnsupportedConfigError
    from legorl_jax.train.plan import plan_learner, read_hf_config

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    try:
        plan = plan_learner(cfg, read_hf_config(source), topology, progress)
    except (PlanError, UnsupportedConfigError) as exc:
        print(f"legorl plan: {exc}", file=sys.stderr)
        return 2
    summary = plan.summary()
    _print(summary)
    if args.json:
        text = json.dumps(summary, indent=2)
        if args.json == "-":
            print(text)
        else:
            Path(args.json).write_text(text + "\n")
    return 0 if plan.fits else 1


def _print(s: dict) -> None:
    print(
        f"{s['topology']}: {s['chips']} chips, {s['devices']} devices, mesh {s['mesh']} "
        f"(compiled in {s['compile_s']:.0f} s)"
    )
    print(
        f"{'program':<42} {'peak GiB':>9} {'args':>7} {'out':>7} {'temp':>7} {'code':>7} {'GFLOP':>9} {'GB moved':>9}"
        "  collectives / kernels"
    )
    for p in s["programs"]:
        coll = ", ".join(f"{k} {v}" for k, v in sorted(p["collectives"].items())) or "none"
        kern = ", ".join(p["kernels"]) or "no custom kernels"
        if p["refused"]:
            coll, kern = "refused by the compiler", p["refused"]
        print(
            f"{p['name']:<42} {p['peak_bytes'] / GIB:>9.2f} {p['argument_bytes'] / GIB:>7.2f} "
            f"{(p['output_bytes'] - p['alias_bytes']) / GIB:>7.2f} {p['temp_bytes'] / GIB:>7.2f} "
            f"{p['code_bytes'] / GIB:>7.3f} {p['flops'] / 1e9:>9.0f} {p['bytes_accessed'] / 1e9:>9.1f}  {coll}; {kern}"
        )
    verdict = "fits" if s["fits"] else "DOES NOT FIT"
    print("(GiB per device; out: outputs not aliased to arguments; peak adds the optimizer state a micro-step keeps)")
    print(
        f"HBM per device: peak {s['hbm_peak_bytes_per_device'] / GIB:.2f} GiB of "
        f"{s['hbm_capacity_bytes_per_device'] / GIB:.2f} GiB: {verdict}"
    )
    print(
        f"a step ({s['micro_steps_per_step']} micro-steps, {s['tokens_per_step']:,} tokens at the longest bucket): "
        f"~{s['estimated_step_s']:.1f} s by the roofline, MFU ~{s['estimated_mfu']:.0%}, "
        f"{s['tokens_per_s_per_chip']:,.0f} tokens/s per chip; limited by {s['limit']} "
        f"({', '.join(f'{k} {v:.3g} s' for k, v in s['bound_s'].items())})"
    )
    if s["platform"] == "gpu":
        print(
            "note: compiled without a GPU, XLA's CUDA compiler gives no cost analysis (the roofline counts "
            "FLOPs only) and attention is compiled blockwise, not as cuDNN's fused kernel (not installed for plans)"
        )
    for line in s["suggestions"]:
        print(f"to fit: {line}")
