#!/usr/bin/env python3
"""What running the learner as one job on several processes adds to a step.

For 1, 2 and 4 JAX processes on this machine (4 CPU devices in all, so the
mesh is the same `fsdp=4` each time; docs/multihost.md), each process builds a
random Qwen3 (float32 master weights) sharded over the mesh, then times, per
repeat:

- broadcast: process 0 `share`s a step's trajectories (`--sequences` ×
  `--tokens` TrainSequences, as `legorl train` does) and every other process
  has them (`coordination.ProcessGroup`: the coordination service's key-value
  store);
- agree: every process packs the step and checks the packed batch's digest
  against the others' (`Learner.batch_digest`);
- gather: the weight export every publish does (`to_hf`'s tensors cast to
  bfloat16 and brought to the host; across processes an all-gather of each
  parameter's shards).

A first, untimed repeat compiles what the others reuse. One process is the
baseline run in the same invocation: it broadcasts and
agrees on nothing, and exports from its own devices. Printed: medians of the
repeats and ratios against the one-process export. All processes share this
machine's two cores, so a real pod (a host each) pays less for the gather.

    .venv/bin/python scripts/bench_multihost.py [--processes 1,2,4] [--size 100m] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time

SIZES = {  # hidden, layers, heads, kv heads, intermediate, vocab
    "demo": (128, 2, 4, 2, 384, 4096),
    "100m": (640, 12, 10, 5, 1728, 32768),
    "400m": (1024, 24, 16, 8, 3072, 32768),
}
DEVICES = 4


def worker(args: argparse.Namespace) -> dict[str, float]:
    import numpy as np
    from flax import nnx

    from legorl_jax.core.config import LearnerConfig, MeshConfig, RLConfig
    from legorl_jax.models import CausalLM, ModelConfig
    from legorl_jax.models.hf_io import _hf_tensors
    from legorl_jax.rl.batching import TrainSequence
    from legorl_jax.train.coordination import ProcessGroup
    from legorl_jax.train.distributed import initialize_distributed
    from legorl_jax.train.sharding import learner_mesh
    from legorl_jax.train.step import Learner

    initialize_distributed()
    hidden, layers, heads, kv_heads, intermediate, vocab = SIZES[args.size]
    config = ModelConfig(
        architecture="qwen3", vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
        num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=64, qk_norm=True,
        param_dtype="float32", compute_dtype="bfloat16",
    )  # fmt: skip
    mesh = learner_mesh(MeshConfig(fsdp=-1))
    learner = Learner(CausalLM(config, rngs=nnx.Rngs(0)), RLConfig(), LearnerConfig(length_buckets=[args.tokens]), mesh)
    group = ProcessGroup()
    rng = np.random.default_rng(0)
    sequences = [
        TrainSequence(
            rng.integers(0, vocab, args.tokens).astype(np.int32),
            np.arange(args.tokens) >= args.tokens // 2,
            -rng.exponential(3, args.tokens).astype(np.float32),
            float(rng.normal()),
        )
        for _ in range(args.sequences)
    ]
    times: dict[str, list[float]] = {"broadcast_s": [], "agree_s": [], "gather_s": []}
    for repeat in range(args.repeats + 1):  # the first compiles the gathers and packing: not timed
        if repeat == 1:
            times = {k: [] for k in times}
        started = time.perf_counter()
        got = asyncio.run(group.share("step", sequences if group.is_leader else None))
        group.agree("received", str(len(got)))  # every process has it: the leader's clock stops here too
        times["broadcast_s"].append(time.perf_counter() - started)
        started = time.perf_counter()
        group.agree("packed batch", learner.batch_digest(learner.pack(got)))
        times["agree_s"].append(time.perf_counter() - started)
        started = time.perf_counter()
        nbytes = sum(a.nbytes for _, a in _hf_tensors(learner.model(), np.dtype("bfloat16")))
        times["gather_s"].append(time.perf_counter() - started)
    out = {k: statistics.median(v) for k, v in times.items()}
    out["weights_bytes"] = float(nbytes)
    out["batch_bytes"] = float(sum(s.token_ids.nbytes + s.loss_mask.nbytes + s.behavior_logprobs.nbytes for s in got))
    return out


def launch(processes: int, args: argparse.Namespace) -> dict[str, float]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={DEVICES // processes}"
    command = [sys.executable, __file__, "--worker", "--size", args.size, "--repeats", str(args.repeats),
               "--sequences", str(args.sequences), "--tokens", str(args.tokens)]  # fmt: skip
    procs = []
    for i in range(processes):
        group = {}
        if processes > 1:
            group = {"JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}", "JAX_NUM_PROCESSES": str(processes),
                     "JAX_PROCESS_ID": str(i)}  # fmt: skip
        procs.append(subprocess.Popen(command, env={**env, **group}, stdout=subprocess.PIPE, text=True))
    outputs = [p.communicate(timeout=1800)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit(f"{processes} processes: exit codes {[p.returncode for p in procs]}")
    return json.loads(outputs[0].strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--processes", default="1,2,4", help="process counts to compare (4 devices in all)")
    parser.add_argument("--size", choices=sorted(SIZES), default="100m")
    parser.add_argument("--sequences", type=int, default=256, help="sequences in the broadcast step")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per sequence")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args)), flush=True)
        return 0
    counts = [int(n) for n in args.processes.split(",")]
    if any(DEVICES % n for n in counts):
        parser.error(f"--processes: each count must divide {DEVICES}")
    results = {}
    for n in counts:
        print(f"{n} process(es) × {DEVICES // n} devices ...", file=sys.stderr, flush=True)
        results[n] = launch(n, args)
    base = results[counts[0]]["gather_s"]
    first = results[counts[0]]
    print(f"size {args.size}: {first['weights_bytes'] / 2**20:.0f} MiB of bf16 weights; "
          f"step batch {first['batch_bytes'] / 2**20:.1f} MiB ({args.sequences} × {args.tokens} tokens)")  # fmt: skip
    print("processes  broadcast_s  agree_s  gather_s  gather/1-proc  (broadcast+agree)/1-proc-gather")
    for n, r in results.items():
        print(f"{n:9d}  {r['broadcast_s']:11.3f}  {r['agree_s']:7.3f}  {r['gather_s']:8.3f}  "
              f"{r['gather_s'] / base:13.2f}  {(r['broadcast_s'] + r['agree_s']) / base:30.2f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
