"""Subprocess bodies for learner tests that need a fresh JAX runtime: a fake
8-device CPU, a `jax.distributed` process group, or a process that dies.

Run as `python workers.py <mode> ...`; results go to stdout as one JSON line.
XLA_FLAGS / JAX_* variables are set by the parent before JAX is imported.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental.multihost_utils import process_allgather  # noqa: E402
from jax.sharding import AxisType, Mesh  # noqa: E402
from tiny import harness_groups, learner_config, random_sequences, rl_config, tiny_model  # noqa: E402

from legorl_jax.core.config import CheckpointConfig, MeshConfig  # noqa: E402
from legorl_jax.models import MESH_AXES  # noqa: E402
from legorl_jax.train.checkpoint import Checkpointer  # noqa: E402
from legorl_jax.train.distributed import initialize_distributed  # noqa: E402
from legorl_jax.train.sharding import learner_mesh  # noqa: E402
from legorl_jax.train.step import Learner  # noqa: E402


def _one_step(mesh: Mesh, scored: bool | None = None) -> tuple[dict, dict, dict]:
    """One step of mostly-scored rows; `scored` True/False: prompt-heavy rows of 256 tokens
    with `score_index` (the LM head at loss targets only) or without (everywhere)."""
    if scored is None:
        cfg, seqs = learner_config(micro_batch_tokens=256), random_sequences(3, 16)
    else:
        cfg, seqs = learner_config(1024).model_copy(update={"length_buckets": [256]}), harness_groups(0)
    learner = Learner(tiny_model(), rl_config(kl_coef=0.05), cfg, mesh)
    packed = learner.pack(seqs)
    if scored is not None:
        assert all(mb.score_index is not None for mb in packed.micro_batches)
        if not scored:
            packed = replace(packed, micro_batches=[replace(mb, score_index=None) for mb in packed.micro_batches])
    grads, _, _ = learner.accumulate(packed)
    # process_allgather: on a multi-process mesh no process holds every shard.
    grads = process_allgather(grads, tiled=True)
    metrics = learner.train_step(packed)
    return metrics, grads, process_allgather(learner.params, tiled=True)


def _max_diff(a: dict, b: dict) -> float:
    return max(float(np.max(np.abs(x - y))) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


def mesh_equivalence(scored: bool = False) -> dict:
    """fsdp=4 × tensor=2 over 8 devices vs a one-device mesh: same loss, grads, update;
    `scored`: the 8 devices compute logprobs only at scored targets, the one device everywhere."""
    one = Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1, 1), MESH_AXES, axis_types=(AxisType.Auto,) * 4)
    big = learner_mesh(MeshConfig(fsdp=4, tensor=2))
    m1, g1, p1 = _one_step(one, False if scored else None)
    m8, g8, p8 = _one_step(big, True if scored else None)
    return {
        "devices": jax.device_count(),
        "loss": [m1["loss"], m8["loss"]],
        "micro_batches": [m1["batch/micro_batches"], m8["batch/micro_batches"]],
        "grad_scale": max(float(np.max(np.abs(g))) for g in jax.tree.leaves(g1)),
        "grad_diff": _max_diff(g1, g8),
        "param_diff": _max_diff(p1, p8),
    }


def distributed_step(tensor: int = 2) -> dict:
    """One step on a mesh spanning every process's devices."""
    joined = initialize_distributed()
    mesh = learner_mesh(MeshConfig(fsdp=-1, tensor=tensor))
    metrics, _, params = _one_step(mesh)
    return {
        "joined": joined,
        "process_index": jax.process_index(),
        "process_count": jax.process_count(),
        "devices": jax.device_count(),
        "loss": metrics["loss"],
        "grad_norm": metrics["grad_norm"],
        "param_sum": float(sum(np.sum(np.asarray(x, np.float64)) for x in jax.tree.leaves(params))),
    }


def train_then_die(ckpt_dir: str, steps: int) -> None:
    """Trains `steps` steps with a checkpoint after each, then is SIGKILLed."""
    learner = Learner(tiny_model(), rl_config(), learner_config(), learner_mesh(MeshConfig()))
    ckpt = Checkpointer(ckpt_dir, CheckpointConfig(every_steps=1, keep=2, async_save=True))
    packed = learner.pack(random_sequences(5, 16))
    for _ in range(steps):
        learner.train_step(packed)
        ckpt.save(learner, policy_version=learner.step, rng=jax.random.key(learner.step), cursor={"seen": learner.step})
    ckpt.wait()
    print(json.dumps({"saved": ckpt.latest_step()}), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["mesh", "scored_mesh", "distributed", "die"])
    parser.add_argument("--dir", default="")
    parser.add_argument("--steps", type=int, default=0)
    args = parser.parse_args()
    if args.mode == "die":
        train_then_die(args.dir, args.steps)
    if args.mode == "distributed":
        result = distributed_step()
    else:
        result = mesh_equivalence(scored=args.mode == "scored_mesh")
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
