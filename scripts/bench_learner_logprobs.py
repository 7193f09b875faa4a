#!/usr/bin/env python3
"""What recording the learner's per-token logprobs costs a train step.

In one process, on one set of devices, the same packed step is trained
alternately by `Learner.train_step` (the baseline: the logprobs stay on
device, unused) and by `Learner.update` followed by
`StepResult.sequence_logprobs()` (what `legorl train` does when
`rollouts.jsonl` keeps token records: copy to host, unpack to each sequence's
token order). Prints median step times, their ratio and the host copy + unpack
alone, as JSON.

    .venv/bin/python scripts/bench_learner_logprobs.py --repeats 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import numpy as np
from flax import nnx

from legorl_jax.core.config import LearnerConfig, MeshConfig, OptimizerConfig, RLConfig
from legorl_jax.models import CausalLM, ModelConfig
from legorl_jax.rl.batching import TrainSequence
from legorl_jax.train.sharding import learner_mesh
from legorl_jax.train.step import Learner

MODEL: dict[str, Any] = dict(
    architecture="qwen3",
    vocab_size=8192,
    hidden_size=256,
    intermediate_size=768,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    head_dim=64,
    qk_norm=True,
    tie_word_embeddings=True,
)


def groups(n_groups: int, members: int, prompt: int, completion: int, seed: int = 0) -> list[TrainSequence]:
    """Groups of `members` sequences sharing a prompt, each with its own sampled completion."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n_groups):
        shared = rng.integers(0, MODEL["vocab_size"], prompt)
        for _ in range(members):
            tokens = np.concatenate([shared, rng.integers(0, MODEL["vocab_size"], completion)]).astype(np.int32)
            mask = np.arange(len(tokens)) >= prompt
            behaviour = np.where(mask, rng.uniform(-8, -0.1, len(tokens)), 0.0).astype(np.float32)
            out.append(TrainSequence(tokens, mask, behaviour, float(rng.normal())))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--members", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=384)
    parser.add_argument("--completion", type=int, default=128)
    args = parser.parse_args()

    seqs = groups(args.groups, args.members, args.prompt, args.completion)
    cfg = LearnerConfig(
        micro_batch_tokens=2048,
        length_buckets=[1024, 2048],
        logprob_chunk_size=512,
        optimizer=OptimizerConfig(learning_rate=1e-6),
    )
    learner = Learner(CausalLM(ModelConfig(**MODEL), rngs=nnx.Rngs(0)), RLConfig(), cfg, learner_mesh(MeshConfig()))
    packed = learner.pack(seqs)
    learner.train_step(packed)  # compile
    learner.update(packed).sequence_logprobs()

    plain, recorded, host = [], [], []
    for _ in range(args.repeats):
        started = time.perf_counter()
        learner.train_step(packed)
        plain.append(time.perf_counter() - started)
        started = time.perf_counter()
        result = learner.update(packed)
        updated = time.perf_counter()
        result.sequence_logprobs()
        done = time.perf_counter()
        recorded.append(done - started)
        host.append(done - updated)
    report = {
        "sequences": len(seqs),
        "trained_tokens": int(sum(s.loss_mask.sum() for s in seqs)),
        "micro_batches": len(packed.micro_batches),
        "train_step_s": statistics.median(plain),
        "update_and_sequence_logprobs_s": statistics.median(recorded),
        "ratio": statistics.median(recorded) / statistics.median(plain),
        "host_copy_and_unpack_s": statistics.median(host),
        "host_share_of_step": statistics.median(host) / statistics.median(plain),
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
