#!/usr/bin/env python3
"""SFT cost on CLI-like demonstrations: the packed layout against the padded rows it replaced.

One CLI's demonstrations in miniature: a long system prompt shared by all
(`--prefix` tokens: a CLI's system prompt and tool list under the CLI model's
8,192-entry tokenizer), then per demonstration its own tail (`--tail` tokens:
a fifth the task's user turn, the rest the answer). The model has the CLI demo
model's shape (`legorl_jax/demo/cli_model.py`), f32. Both layouts go through
the warm start's step (`legorl sft`'s `Learner`, `Learner.accumulate`) in this process:

- padded (before): each demonstration its own row, padded to the longest,
  one row per call: what a step of the CLI spec's old batch of 1 computed;
- packed (now): the CLI spec's SFT packing: length buckets up to
  `sft.row_tokens` and the shared prompt laid out once as a trie.

Prints, per layout, the best wall time of loss + gradient over all the
demonstrations (after one compiling call; the optimizer update, milliseconds
for this model, is left out), tokens computed, the loss, and the ratios.
`--scale N` divides every length by N where the full size would take too long.

    .venv/bin/python scripts/bench_sft.py --scale 2
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

import jax
import numpy as np
from flax import nnx

from legorl_jax.core.config import LearnerConfig, MeshConfig, RLConfig
from legorl_jax.demo.cli_model import CLI_DEMO_SPEC
from legorl_jax.demo.demonstrations import Demonstration
from legorl_jax.demo.sft import SFTData, learner_config, prepare, step_sequences
from legorl_jax.models import CausalLM, ModelConfig
from legorl_jax.rl.batching import PackedStep
from legorl_jax.train.sft import sft_rl
from legorl_jax.train.sharding import learner_mesh
from legorl_jax.train.step import Learner


def cli_like(prefix: int, tail: int, demos: int, vocab: int, seed: int = 0) -> list[Demonstration]:
    """`demos` demonstrations of one CLI: a shared `prefix`, then each its own user turn and answer."""
    rng = np.random.default_rng(seed)
    system = rng.integers(1, vocab, prefix).tolist()
    user = tail // 5
    out = []
    for i in range(demos):
        ids = system + rng.integers(1, vocab, tail).tolist()
        mask = (0,) * (prefix + user) + (1,) * (tail - user)
        out.append(Demonstration(f"task{i}", "cli", "direct", ((tuple(ids), mask),)))
    return out


def cli_model() -> CausalLM:
    spec = CLI_DEMO_SPEC
    config = ModelConfig(
        architecture="qwen3",
        qk_norm=True,
        tie_word_embeddings=True,
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_layers=spec.num_layers,
        num_heads=spec.num_heads,
        num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        param_dtype="float32",
        compute_dtype="float32",
    )
    return CausalLM(config, rngs=nnx.Rngs(0))


def layouts(model: CausalLM, data: SFTData) -> dict[str, tuple[Learner, PackedStep]]:
    """Per layout, a learner packing that way and its packing of every demonstration as one step."""
    rows = list(range(len(data.tokens)))
    width = data.tokens.shape[1]
    padded = LearnerConfig(length_buckets=[width], micro_batch_tokens=width, share_prefixes=False)
    mesh = learner_mesh(MeshConfig())
    learners = {
        "padded": Learner(model, sft_rl(RLConfig()), padded, mesh, max_segments=1),
        "packed": Learner(model, sft_rl(RLConfig()), learner_config(CLI_DEMO_SPEC.sft, width), mesh),
    }
    return {name: (learner, learner.pack(step_sequences(data, rows))) for name, learner in learners.items()}


def timed(learner: Learner, packed: PackedStep, repeats: int) -> tuple[float, float]:
    """(best wall seconds, loss) of the loss and gradient over the packed step, after a compiling call."""
    grads, numerator, _ = learner.accumulate(packed)
    jax.block_until_ready(grads)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(learner.accumulate(packed)[0])
        best = min(best, time.perf_counter() - start)
    return best, float(numerator) / packed.normaliser


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefix", type=int, default=8192, help="Shared system prompt tokens.")
    parser.add_argument("--tail", type=int, default=512, help="Each demonstration's own tokens.")
    parser.add_argument("--demos", type=int, default=CLI_DEMO_SPEC.sft.batch_size, help="Demonstrations per step.")
    parser.add_argument("--scale", type=int, default=1, help="Divide --prefix and --tail by this.")
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    prefix, tail = -(-args.prefix // args.scale), -(-args.tail // args.scale)
    model = cli_model()
    data = prepare(cli_like(prefix, tail, args.demos, CLI_DEMO_SPEC.vocab_size), pad_id=0)
    report: dict[str, Any] = {
        "prefix": prefix,
        "tail": tail,
        "demos": args.demos,
        "platform": jax.devices()[0].platform,
        "host_cpus": os.cpu_count(),
    }
    for name, (learner, packed) in layouts(model, data).items():
        seconds, loss = timed(learner, packed, args.repeats)
        report[name] = {
            "seconds": round(seconds, 3),
            "loss": loss,
            "calls": len(packed.micro_batches),
            "row_shapes": sorted({mb.tokens.shape for mb in packed.micro_batches}),
            "tokens_computed": int(packed.stats["batch/computed_tokens"]),
            "token_slots": int(sum(mb.tokens.size for mb in packed.micro_batches)),
        }
        print(name, json.dumps(report[name]), flush=True)
    report["time_ratio"] = report["packed"]["seconds"] / report["padded"]["seconds"]
    report["loss_rel_diff"] = abs(report["packed"]["loss"] / report["padded"]["loss"] - 1)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
