"""Tiny models and synthetic trajectories shared by the learner tests and their
subprocess workers (which import this file by path)."""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx

from legorl_jax.core.config import LearnerConfig, OptimizerConfig, RLConfig
from legorl_jax.models import CausalLM, ModelConfig, token_logprobs
from legorl_jax.rl.batching import TrainSequence

VOCAB = 128


def tiny_config(**overrides: object) -> ModelConfig:
    base = dict(
        architecture="qwen3",
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        qk_norm=True,
        tie_word_embeddings=True,
    )
    return ModelConfig(**{**base, **overrides})  # type: ignore[arg-type]


def tiny_model(seed: int = 0, **overrides: object) -> CausalLM:
    return CausalLM(tiny_config(**overrides), rngs=nnx.Rngs(seed))


def random_sequences(seed: int, n: int = 12, max_len: int = 40) -> list[TrainSequence]:
    """Prompt-then-completion sequences with engine logprobs near a uniform policy's."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        length = int(rng.integers(6, max_len))
        mask = np.arange(length) >= int(rng.integers(1, 5))
        behav = np.where(mask, -np.log(VOCAB) + rng.normal(0, 0.3, length), 0.0).astype(np.float32)
        out.append(TrainSequence(rng.integers(0, VOCAB, length).astype(np.int32), mask, behav, float(rng.normal())))
    return out


def learner_config(micro_batch_tokens: int = 128, lr: float = 1e-2) -> LearnerConfig:
    return LearnerConfig(
        micro_batch_tokens=micro_batch_tokens,
        length_buckets=[64],
        logprob_chunk_size=48,
        # A large eps stops Adam's sign-like first step from turning float noise in
        # near-zero gradients into ±lr updates, so parameters compare tightly
        # across micro-batchings and meshes.
        optimizer=OptimizerConfig(learning_rate=lr, schedule="cosine", total_steps=20, eps=1e-3),
    )


def rl_config(**overrides: object) -> RLConfig:
    return RLConfig(**{"tis_cap": 2.0, "mis_cap": 50.0, **overrides})  # type: ignore[arg-type]


def sequence_logprobs(model: CausalLM, token_ids: list[np.ndarray], temperature: float = 1.0) -> list[np.ndarray]:
    """Each sequence's per-token logprobs under `model` (0 at index 0), from one
    jitted call on right-padded rows (padding cannot reach earlier tokens)."""
    width = max(len(t) for t in token_ids)
    rows = np.zeros((len(token_ids), width), np.int32)
    for r, t in enumerate(token_ids):
        rows[r, : len(t)] = t
    lp = np.asarray(jax.jit(lambda m, x: token_logprobs(m, x, temperature=temperature))(model, rows))
    return [np.concatenate([[0.0], lp[r, : len(t) - 1]]).astype(np.float32) for r, t in enumerate(token_ids)]


def harness_groups(seed: int = 0, configs: int = 2, tasks: int = 2, members: int = 4) -> list[TrainSequence]:
    """Groups whose members share system prefix + task text; configurations share the system prefix.

    Some members run a second turn (prompt tokens after sampled ones), and each
    sampled token's engine logprob is unique, so tests can find it again.
    """
    rng = np.random.default_rng(seed)
    seqs = []
    for _ in range(configs):
        system = rng.integers(0, VOCAB, 24)
        for _ in range(tasks):
            prompt = np.concatenate([system, rng.integers(0, VOCAB, 8)])
            for m in range(members):
                turn = rng.integers(0, VOCAB, int(rng.integers(4, 10)))
                tail = rng.integers(0, VOCAB, 4 * (m % 2))  # a tool result and a second answer
                tokens = np.concatenate([prompt, turn, tail, tail]).astype(np.int32)
                mask = np.zeros(len(tokens), bool)
                mask[len(prompt) : len(prompt) + len(turn)] = True
                mask[len(tokens) - len(tail) :] = True
                behav = np.where(mask, rng.uniform(-6.0, -0.05, len(tokens)), 0.0).astype(np.float32)
                seqs.append(TrainSequence(tokens, mask, behav, float(rng.normal())))
    return seqs
