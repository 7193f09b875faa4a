#!/usr/bin/env python3
"""The learner's step with logprobs at scored targets only (`MicroBatch.score_index`) against
the LM head at every target (the same packed step with `score_index` dropped), in one process.

Cases, each one `Learner.update` per path, the paths alternating, best of `--repeats` after a
compiling step:

- cli: `legorl sft`'s step (nll loss, prefix sharing) at the CLI demo model's shape (f32) on
  the recorded CLI episodes of `scripts/bench_cli_sft.py` (8 of one CLI per step), when its
  cache (`$LEGORL_CACHE/bench_cli_sft/`) is there;
- lego: a lego-demo-like RL step (configs/demo.yaml's learner, ppo_clip) at the demo model's
  shape: 8 groups of 4 synthetic ~1k-token episodes, 3 turns each;
- large: one long prompt and its completion at a large vocabulary (`--large-*`).

Prints per case the step seconds on and off, their ratio, the loss and gradient max relative
differences (from `Learner.accumulate` on the same parameters), and the micro-batch shapes
(each one compiled program per path).

    PYTHONPATH=. .venv/bin/python scripts/bench_scored_positions.py [--cases cli,lego,large] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import replace
from typing import Any

import jax
import numpy as np
from flax import nnx

from legorl_jax.core.config import LearnerConfig, MeshConfig, OptimizerConfig, RLConfig, cache_root
from legorl_jax.demo.demo_model import DemoModelSpec
from legorl_jax.models import CausalLM, ModelConfig
from legorl_jax.rl.batching import PackedStep, TrainSequence
from legorl_jax.train.sharding import learner_mesh
from legorl_jax.train.step import Learner

# A demo model spec's fields that give the model's shape (`DemoModelSpec`).
DIMS = {"vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "intermediate_size"}


def _model(**dims: int) -> CausalLM:
    """A Qwen3-architecture model of the given `DIMS`, in float32."""
    config = ModelConfig(
        architecture="qwen3",
        qk_norm=True,
        tie_word_embeddings=True,
        param_dtype="float32",
        compute_dtype="float32",
        **dims,  # type: ignore[arg-type]
    )
    return CausalLM(config, rngs=nnx.Rngs(0))


def _all_targets(packed: PackedStep) -> PackedStep:
    return replace(packed, micro_batches=[replace(mb, score_index=None) for mb in packed.micro_batches])


def _shapes(packed: PackedStep) -> list[str]:
    """One entry per distinct micro-batch program: rows x bucket, score width, tree or not."""
    out = set()
    for mb in packed.micro_batches:
        width = "all" if mb.score_index is None else str(mb.score_index.shape[1])
        out.add(f"{mb.tokens.shape[0]}x{mb.tokens.shape[1]} S={width}{' tree' if mb.tree else ''}")
    return sorted(out)


def _rel(a: Any, b: Any) -> float:
    return max(
        float(np.max(np.abs(np.asarray(x) - np.asarray(y))) / (np.max(np.abs(np.asarray(y))) + 1e-30))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


def compare(model: CausalLM, rl: RLConfig, cfg: LearnerConfig, seqs: list[TrainSequence], repeats: int) -> dict:
    learner = Learner(model, rl, cfg, learner_mesh(MeshConfig()))
    on = learner.pack(seqs)
    off = _all_targets(on)
    g_on, n_on, _ = jax.device_get(learner.accumulate(on))
    g_off, n_off, _ = jax.device_get(learner.accumulate(off))
    seconds: dict[str, list[float]] = {"on": [], "off": []}
    for _ in range(repeats + 1):
        for path, packed in (("on", on), ("off", off)):
            start = time.perf_counter()
            learner.update(packed)  # its metrics come to host: the step is done
            seconds[path].append(time.perf_counter() - start)
    best = {k: min(v[1:]) for k, v in seconds.items()}
    return {
        "sequences": len(seqs),
        "tokens": int(on.stats["batch/tokens"]),
        "loss_tokens": int(on.stats["batch/loss_tokens"]),
        "computed_tokens": int(on.stats["batch/computed_tokens"]),
        "shapes_on": _shapes(on),
        "shapes_off": _shapes(off),
        "step_s_on": round(best["on"], 4),
        "step_s_off": round(best["off"], 4),
        "ratio_on_off": round(best["on"] / best["off"], 3),
        "first_step_s_on": round(seconds["on"][0], 2),
        "first_step_s_off": round(seconds["off"][0], 2),
        "loss_rel_diff": abs(float(n_on) / float(n_off) - 1),
        "grad_max_rel_diff": _rel(g_on, g_off),
    }


def _sequence(ids: np.ndarray, mask: np.ndarray, rng: np.random.Generator) -> TrainSequence:
    behav = np.where(mask, rng.uniform(-6.0, -0.05, len(ids)), 0.0).astype(np.float32)
    return TrainSequence(ids.astype(np.int32), mask, behav, float(rng.normal()))


def cli_case(repeats: int) -> dict[str, Any] | None:
    """Per recorded CLI, its first 8 episodes as one SFT step at the CLI demo model's shape."""
    from legorl_jax.demo.cli_model import CLI_DEMO_SPEC
    from legorl_jax.train.sft import sft_rl

    files = sorted((cache_root() / "bench_cli_sft").glob("*.json"))
    if not files:
        print("cli: no recorded episodes (run scripts/bench_cli_sft.py once); skipped")
        return None
    rows = json.loads(files[0].read_text())["rows"]
    spec, sft = CLI_DEMO_SPEC, CLI_DEMO_SPEC.sft
    top = sft.row_tokens or 12288
    # The CLI spec's row ladder: 512, 768, 1024, 1536, ... below its row length, then the row length.
    buckets = sorted({b << k for b in (512, 768) for k in range(top.bit_length()) if b << k < top} | {top})
    cfg = LearnerConfig(
        micro_batch_tokens=sft.micro_batch_tokens or top,
        length_buckets=buckets,
        share_prefixes=True,
        optimizer=OptimizerConfig(learning_rate=sft.learning_rate, schedule="constant"),
    )
    rng = np.random.default_rng(0)
    out = {}
    for harness in dict.fromkeys(r["harness"] for r in rows):
        picked = [r for r in rows if r["harness"] == harness][: sft.batch_size]
        seqs = [_sequence(np.asarray(r["ids"]), np.asarray(r["mask"], bool), rng) for r in picked]
        out[harness] = compare(_model(**spec.model_dump(include=DIMS)), sft_rl(RLConfig()), cfg, seqs, repeats)
        print(f"cli {harness}", json.dumps(out[harness]), flush=True)
    return out


def lego_case(repeats: int) -> dict[str, Any]:
    """configs/demo.yaml's step shape: 8 groups of 4; a configuration's system prompt, the task, then
    3 turns of a sampled answer and a tool result (~1k tokens, a fifth of them sampled)."""
    rng = np.random.default_rng(1)
    vocab = 2048
    seqs = []
    systems = [rng.integers(0, vocab, 400) for _ in range(2)]
    for g in range(8):
        prompt = np.concatenate([systems[g % 2], rng.integers(0, vocab, 100)])
        for _ in range(4):
            parts, mask = [prompt], [np.zeros(len(prompt), bool)]
            for _ in range(3):
                answer, result = rng.integers(0, vocab, int(rng.integers(40, 90))), rng.integers(0, vocab, 100)
                parts += [answer, result]
                mask += [np.ones(len(answer), bool), np.zeros(len(result), bool)]
            seqs.append(_sequence(np.concatenate(parts), np.concatenate(mask), rng))
    cfg = LearnerConfig(micro_batch_tokens=8192, length_buckets=[512, 1024, 2048], logprob_chunk_size=512)
    rl = RLConfig(loss="ppo_clip", tis_cap=2.0)
    spec = DemoModelSpec()  # the lego demo's model: vocabulary 2,048, hidden 128, 2 layers
    assert spec.vocab_size == vocab
    out = compare(_model(**spec.model_dump(include=DIMS)), rl, cfg, seqs, repeats)
    print("lego", json.dumps(out), flush=True)
    return out


def large_case(args: argparse.Namespace) -> dict[str, Any]:
    """One prompt of `--large-prompt` tokens and a completion of `--large-completion`."""
    rng = np.random.default_rng(2)
    n = args.large_prompt + args.large_completion
    mask = np.arange(n) >= args.large_prompt
    seqs = [_sequence(rng.integers(0, args.large_vocab, n), mask, rng)]
    bucket = 1 << (n - 1).bit_length()
    cfg = LearnerConfig(micro_batch_tokens=bucket, length_buckets=[bucket], logprob_chunk_size=512)
    rl = RLConfig(loss="ppo_clip", tis_cap=2.0)
    h = args.large_hidden
    model = _model(
        vocab_size=args.large_vocab,
        hidden_size=h,
        num_layers=args.large_layers,
        num_heads=max(h // 128, 1),
        num_kv_heads=max(h // 256, 1),
        head_dim=128,
        intermediate_size=3 * h,
    )
    out = {
        "shape": f"vocab {args.large_vocab}, hidden {h}, {args.large_layers} layers, "
        f"{args.large_prompt}+{args.large_completion} tokens",
        **compare(model, rl, cfg, seqs, args.repeats),
    }
    print("large", json.dumps(out), flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default="cli,lego,large")
    parser.add_argument("--repeats", type=int, default=2, help="Timed steps per path after the compiling one.")
    parser.add_argument("--large-vocab", type=int, default=151936)
    parser.add_argument("--large-hidden", type=int, default=1024)
    parser.add_argument("--large-layers", type=int, default=2)
    parser.add_argument("--large-prompt", type=int, default=20000)
    parser.add_argument("--large-completion", type=int, default=1000)
    args = parser.parse_args()
    cases = args.cases.split(",")
    results: dict[str, Any] = {"platform": jax.devices()[0].platform, "host_cpus": os.cpu_count()}
    if "cli" in cases:
        results["cli"] = cli_case(args.repeats)
    if "lego" in cases:
        results["lego"] = lego_case(args.repeats)
    if "large" in cases:
        results["large"] = large_case(args)
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
