#!/usr/bin/env python3
"""Weight-sync benchmark: from the end of a learner step to every host serving it.

A random Qwen3 (~100M or ~400M parameters, float32 master weights, bfloat16
compute) takes real AdamW steps at lr 1e-6 on random tokens; after each step
`DirectoryPublisher` publishes it in bfloat16 (a full checkpoint every
`--full-every` versions, deltas between) and `WeightStreamer` delivers it to
N weights-only rollout hosts (`rollout_server.weight_host`, each its own
process: the real `RolloutService` weight handlers over an engine that reads
the weights into host memory), relayed host to host in a chain. The wall
time from the end of the step to all N hosts serving the version (GetStatus)
is compared with one raw copy of the full bf16 checkpoint (`shutil.copyfile`
of its safetensors files, from the page cache), the baseline of
scripts/bench_train.py. Bytes: what the learner's link sends per step (once
with a relay chain; N times with direct streams, run as a reference at the
largest N) and the changed fraction of elements per delta step.

Then the host's delta install alone, in this process: `install_delta` of one
delta version read back from the served directory (as before the served
tensors were kept in memory) against patching the tensors held in memory
(`ServedTensors`), alternated, medians; the engine stand-in's reload
(reading the new directory) and the result's digest for scale.

Last, the floor (`--floor-repeats`): the parts every publish must do on
this machine whatever the transport, each timed alone in this process and
alternated with the raw copy: the export (cast to bf16 and device to host:
here the device is this CPU), the bit comparison with the previous version
(positions of the changed elements, the least a delta encoder does), the
digest (SHA-256 of every tensor, parallel), the write of the full files
(as new files, and again over the files just written, as a host writes a
version over one it prunes) and their read back (what an engine that
reloads from a directory needs).
Their sums bound what any implementation can reach here against the targets.

All N hosts share this machine's cores with the learner, so per-host CPU
work (patching, hashing, writing, reloading) adds up with N here, where a
real fleet gives every host its own.

With `--engines embedded,vllm` (opt-in: vLLM's CPU build starts in minutes
here), into real engines: each engine launched as the project launches it
(`rollout_server.backends.launch.start_engine`, ephemeral ports, its default
dtype: embedded float32, vLLM bfloat16 from the bf16 checkpoint) on version 0;
then per version a model of new random weights (seed = version, so a reload
that loads nothing fails the check) is published by `DirectoryPublisher`
(bf16, a full checkpoint every version: an engine reloads a directory) and
installed into each engine in turn (the order alternating per version) by
the client's `update_weights` (pause → /collective_rpc reload → reset prefix
cache → label → resume). Each install is checked with the served-weights probe
(`served_probe.probe_engine`: the engine's logprobs of the version's probe
against the learner's). Last, one more version reaches each engine the
other way, by a restart: `stop` and `start_engine` on the new directory.
`--engines-only` skips everything else.

    .venv/bin/python scripts/bench_weight_sync.py [--sizes 100m,400m] [--hosts 1,2,4,8] [--steps 3]
    .venv/bin/python scripts/bench_weight_sync.py --sizes 100m --engines embedded,vllm --engines-only
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import math
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from legorl_jax.core import safetensors_io
from legorl_jax.core.config import EngineConfig
from legorl_jax.core.weight_delta import read_header, tensor_sums
from legorl_jax.core.weight_layout import DELTA_FILE, read_manifest, read_tensors
from legorl_jax.models import CausalLM
from legorl_jax.models.config import ModelConfig
from legorl_jax.models.hf_io import _hf_tensors
from legorl_jax.models.tokenizer import build_demo_tokenizer
from legorl_jax.train.publish import DirectoryPublisher
from legorl_jax.train.weight_stream import WeightStreamer
from rollout_server.backends.launch import ManagedEngine, start_engine
from rollout_server.backends.served_probe import probe_engine
from rollout_server.served_tensors import Held, ServedTensors
from rollout_server.weights import install_delta

SIZES = {
    # name: (hidden, layers, heads, kv heads, intermediate); vocab 32768, head_dim 64, untied embeddings.
    "100m": (768, 8, 12, 4, 2048),
    "400m": (1024, 26, 16, 8, 3072),
}
LR = 1e-6
TOKENS = 64


def make_model(size: str, seed: int = 0, tied: bool = False) -> CausalLM:
    hidden, layers, heads, kv_heads, intermediate = SIZES[size]
    config = ModelConfig(
        architecture="qwen3", vocab_size=32768, hidden_size=hidden, intermediate_size=intermediate,
        num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=64, qk_norm=True,
        param_dtype="float32", compute_dtype="bfloat16", tie_word_embeddings=tied,
    )  # fmt: skip
    return CausalLM(config, rngs=nnx.Rngs(seed))


def learner_steps(size: str, steps: int) -> Iterator[tuple[CausalLM, float]]:
    """The model before training, then after each AdamW step, with the step's seconds."""
    model = make_model(size)
    graph, params, *others = nnx.split(model, nnx.Param, ...)  # others: the one state of `...`
    rest = others[0]
    tx = optax.adamw(LR)
    opt_state = tx.init(params)

    # Donated: old and new parameters and optimizer state never coexist (the 400M case is tight in 24 GB).
    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(params: nnx.State, opt_state: optax.OptState, tokens: jax.Array) -> tuple[nnx.State, optax.OptState]:
        def loss(p: nnx.State) -> jax.Array:
            logits = nnx.merge(graph, p, rest)(tokens[:, :-1])
            return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

        updates, opt_state = tx.update(jax.grad(loss)(params), opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    yield model, 0.0
    keys = jax.random.split(jax.random.key(1), steps)
    for key in keys:
        tokens = jax.random.randint(key, (1, TOKENS + 1), 0, 32768)
        started = time.monotonic()
        params, opt_state = jax.block_until_ready(step(params, opt_state, tokens))
        yield nnx.merge(graph, params, rest), time.monotonic() - started


@contextlib.contextmanager
def host_processes(count: int, scratch: Path) -> Iterator[list[str]]:
    """`count` weights-only rollout hosts, each its own process; their addresses."""
    procs = []
    try:
        for i in range(count):
            root = scratch / f"host{i}"
            argv = ["--root", str(root), "--weights-root", str(scratch)]  # the publisher writes under scratch
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "rollout_server.weight_host", *argv],
                stdout=subprocess.PIPE, text=True,
            ))  # fmt: skip
        addresses = []
        for proc in procs:
            assert proc.stdout is not None
            addresses.append(proc.stdout.readline().strip())
            if not addresses[-1]:
                raise RuntimeError(f"weight host {proc.pid} did not start")
        yield addresses
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=30)


def raw_copy_s(directory: Path, dest: Path, repeat: int = 3) -> tuple[float, int]:
    """Median seconds of one copy of the checkpoint's safetensors files, and their bytes."""
    files = sorted(directory.glob("*.safetensors"))
    times = []
    for _ in range(repeat):
        shutil.rmtree(dest, ignore_errors=True)
        dest.mkdir(parents=True)
        started = time.monotonic()
        for f in files:
            shutil.copyfile(f, dest / f.name)
        times.append(time.monotonic() - started)
    shutil.rmtree(dest, ignore_errors=True)
    return statistics.median(times), sum(f.stat().st_size for f in files)


async def run(size: str, hosts: list[str], relay: bool, args: argparse.Namespace, scratch: Path) -> dict[str, float]:
    """Publish + sync after each learner step; seconds and bytes of the full and the delta versions."""
    root = scratch / f"pub-{size}-{len(hosts)}-{relay}"
    publisher = DirectoryPublisher(root, keep=2, dtype="bfloat16", full_every=args.full_every)
    streamer = WeightStreamer(hosts, relay=relay)
    full, deltas, fractions, delta_bytes, publish_delta = {}, [], [], [], []
    for version, (model, _) in enumerate(learner_steps(size, args.steps)):
        if version == 0:  # warm-up: the first export compiles the casts, which a running learner has long done
            DirectoryPublisher(scratch / "warm-up", dtype="bfloat16").publish(model, 0)
        started = time.monotonic()
        location = await asyncio.to_thread(publisher.publish, model, version)
        published = time.monotonic()
        loaded = await streamer.update_weights(version, location)
        done = time.monotonic()
        assert loaded == dict.fromkeys(hosts, version), loaded
        stats = publisher.last
        assert stats is not None
        if stats.kind == "full":
            copy_s, nbytes = raw_copy_s(Path(location), scratch / "raw")
            full = {"sync_s": done - started, "publish_s": published - started, "copy_s": copy_s, "bytes": nbytes}
        else:
            deltas.append(done - started)
            publish_delta.append(published - started)
            fractions.append(stats.changed_fraction)
            delta_bytes.append(stats.nbytes)
    shutil.rmtree(root, ignore_errors=True)
    return {
        **full,
        "delta_sync_s": statistics.median(deltas),
        "delta_publish_s": statistics.median(publish_delta),
        "changed": statistics.median(fractions),
        "delta_bytes": statistics.median(delta_bytes),
    }


def host_install(size: str, scratch: Path, repeats: int) -> dict[str, float]:
    """Median seconds of one delta install on a host: base read from disk, base
    held in memory (alternated, so both see the same load), a reload of the
    result and its SHA-256 digest alone; and the share of the elements in
    tensors the delta changed (what the host rehashes)."""
    root = scratch / f"ab-{size}"
    publisher = DirectoryPublisher(root, keep=2, dtype="bfloat16", full_every=8)
    for version, (model, _) in enumerate(learner_steps(size, 1)):
        publisher.publish(model, version)
    base, blob = root / "v00000000", (root / "v00000001" / DELTA_FILE).read_bytes()
    manifest = read_manifest(base)
    assert manifest is not None
    header = read_header(blob)
    changed_bytes = sum(math.prod(t["shape"]) for t in header.tensors if t["changed"])
    times: dict[str, list[float]] = {"disk": [], "memory": [], "reload": [], "digest": []}
    for i in range(repeats):
        for mode in ("disk", "memory") if i % 2 == 0 else ("memory", "disk"):
            memory = ServedTensors()
            if mode == "memory":  # what the previous install left held (untimed)
                tensors = read_tensors(base)
                memory.hold(Held(base, manifest.digest, tensors, tensor_sums(tensors)))
            started = time.monotonic()
            _, final = install_delta(
                base, blob, scratch / f"ab-host-{mode}", memory=memory if mode == "memory" else None
            )
            times[mode].append(time.monotonic() - started)
            started = time.monotonic()
            result = read_tensors(final)
            times["reload"].append(time.monotonic() - started)
            started = time.monotonic()
            tensor_sums(result)
            times["digest"].append(time.monotonic() - started)
            shutil.rmtree(scratch / f"ab-host-{mode}")
    shutil.rmtree(root, ignore_errors=True)
    return {**{k: statistics.median(v) for k, v in times.items()}, "rehashed": changed_bytes / header.total}


def floor(size: str, scratch: Path, repeats: int) -> dict[str, float]:
    """Median seconds of each part every publish does here, alternated with a
    raw copy of the full bf16 files (see the module docstring)."""
    steps = learner_steps(size, 1)
    # Exported before the step: it donates the parameters the model before it holds.
    before = dict(_hf_tensors(next(steps)[0], jnp.dtype("bfloat16")))
    trained = next(steps)[0]
    files, out = scratch / "floor-files", scratch / "floor-write"
    files.mkdir()
    safetensors_io.save_file(before, files / "model.safetensors")

    def export() -> None:
        dict(_hf_tensors(trained, jnp.dtype("bfloat16")))

    after = dict(_hf_tensors(trained, jnp.dtype("bfloat16")))

    def compare() -> None:
        for name, array in after.items():
            np.flatnonzero(array.view(np.uint16) != before[name].view(np.uint16))

    def write() -> None:
        out.mkdir(exist_ok=True)
        safetensors_io.save_file(after, out / "model.safetensors")

    parts = {
        "export": export,
        "compare": compare,
        "digest": lambda: tensor_sums(after),
        "write": write,
        "rewrite": write,  # over the file just written, as a host writes over a version it prunes
        "read": lambda: read_tensors(out),
    }
    times: dict[str, list[float]] = {"copy": [], **{name: [] for name in parts}}
    for _ in range(repeats):
        times["copy"].append(raw_copy_s(files, scratch / "floor-raw", repeat=1)[0])
        for name, part in parts.items():
            started = time.monotonic()
            part()
            times[name].append(time.monotonic() - started)
        shutil.rmtree(out)
    shutil.rmtree(files)
    return {name: statistics.median(t) for name, t in times.items()}


def progress(what: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {what}", file=sys.stderr, flush=True)


def launch(kind: str, weights: str, scratch: Path, name: str, dtype: str | None) -> tuple[ManagedEngine, float]:
    """An engine of `kind` serving `weights`, as the project launches it; with its start-up seconds."""
    started = time.monotonic()
    config = EngineConfig.model_validate({"kind": kind, "port": 0, "dtype": dtype})  # port 0: an ephemeral one
    engine = start_engine(config, weights, log_path=scratch / f"{name}.log")
    return engine, time.monotonic() - started


def probed(engine: ManagedEngine, weights: str) -> tuple[bool, float]:
    """Whether the engine serves `weights` (the served-weights probe), and the probe's max logprob difference."""
    client = engine.sync_client()
    try:
        result = client.run(probe_engine(client.async_client, weights, engine.dtype))
    finally:
        client.close()
    assert result is not None, f"{weights} carries no probe"
    return result.passed, result.max_abs_diff


def engine_sync(size: str, kinds: list[str], args: argparse.Namespace, scratch: Path) -> None:
    """Publish + update_weights into real engines, then the same version by a restart (module docstring)."""
    tokenizer = build_demo_tokenizer(scratch / "tokenizer")
    publisher = DirectoryPublisher(scratch / f"engines-{size}", keep=3, tokenizer_from=tokenizer, dtype="bfloat16")
    base = publisher.publish(make_model(size, 0, args.tied), 0)
    engines: dict[str, ManagedEngine] = {}
    dtypes = {"embedded": None, "vllm": args.vllm_dtype}  # None: the engine's default
    start_s: dict[str, float] = {}
    updates: dict[str, list[float]] = {kind: [] for kind in kinds}
    checks: dict[str, list[tuple[bool, float]]] = {kind: [] for kind in kinds}
    publish_s: list[float] = []
    try:
        for kind in kinds:
            progress(f"starting {kind} on {base}")
            engines[kind], start_s[kind] = launch(kind, base, scratch, f"{kind}-{size}", dtypes[kind])
            progress(f"{kind} up in {start_s[kind]:.0f} s; probe {probed(engines[kind], base)}")
        for version in range(1, args.engine_versions + 2):
            model = make_model(size, version, args.tied)
            started = time.monotonic()
            location = publisher.publish(model, version)
            publish_s.append(time.monotonic() - started)
            del model
            order = kinds if version % 2 else kinds[::-1]
            for kind in order:
                started = time.monotonic()
                if version <= args.engine_versions:  # the native reload
                    method = (
                        {"reload_method": args.vllm_reload_method} if kind == "vllm" and args.vllm_reload_method else {}
                    )
                    client = engines[kind].sync_client(**method)
                    try:
                        client.update_weights(location, version=f"v{version}")
                    finally:
                        client.close()
                    updates[kind].append(time.monotonic() - started)
                else:  # the last version by a restart on its directory
                    engines[kind].stop()
                    engines[kind], _ = launch(kind, location, scratch, f"{kind}-{size}-restart", dtypes[kind])
                    updates[kind].append(time.monotonic() - started)
                checks[kind].append(probed(engines[kind], location))
                how = "update_weights" if version <= args.engine_versions else "restart"
                progress(f"v{version} {kind}: publish {publish_s[-1]:.2f} s, {how} {updates[kind][-1]:.2f} s, "
                         f"probe (passed, max diff) {checks[kind][-1]}")  # fmt: skip
    finally:
        for engine in engines.values():
            engine.stop()
    copy_s, nbytes = raw_copy_s(Path(location), scratch / "raw")  # the last version: base is pruned by now
    baseline = kinds[0]
    reload = {kind: statistics.median(updates[kind][:-1]) for kind in kinds}
    publish = statistics.median(publish_s)
    reload_by = f", vLLM reloads by {args.vllm_reload_method}" if args.vllm_reload_method and "vllm" in kinds else ""
    reload_by += f", vLLM in {args.vllm_dtype}" if args.vllm_dtype and "vllm" in kinds else ""
    print(f"\n{size}{' tied' if args.tied else ''}{reload_by} into engines: full bf16 checkpoint {nbytes / 1e6:.0f} MB "
          f"(raw copy {copy_s:.3f} s); publish median {publish:.2f} s; medians of {args.engine_versions} "
          f"update(s), then one restart; x: against {baseline}")  # fmt: skip
    print("| engine | first start s | update_weights s | x | publish + update s | x | probe after updates "
          "(max diff) | restart s | x | restart / update | probe after restart |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for kind in kinds:
        passed = all(ok for ok, _ in checks[kind][:-1])
        worst = max(diff for _, diff in checks[kind][:-1])
        restart, last = updates[kind][-1], checks[kind][-1]
        print(f"| {kind} | {start_s[kind]:.1f} | {reload[kind]:.2f} | {reload[kind] / reload[baseline]:.2f}x | "
              f"{publish + reload[kind]:.2f} | {(publish + reload[kind]) / (publish + reload[baseline]):.2f}x | "
              f"{'passed' if passed else 'FAILED'} ({worst:.3g}) | {restart:.1f} | "
              f"{restart / updates[baseline][-1]:.2f}x | {restart / reload[kind]:.0f}x | "
              f"{'passed' if last[0] else 'FAILED'} ({last[1]:.3g}) |", flush=True)  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="100m,400m")
    parser.add_argument("--hosts", default="1,2,4,8", help="fleet sizes N")
    parser.add_argument("--steps", type=int, default=3, help="learner steps (delta versions) per fleet size")
    parser.add_argument("--full-every", type=int, default=8)
    parser.add_argument("--install-repeats", type=int, default=6, help="host delta installs per mode (0: none)")
    parser.add_argument("--floor-repeats", type=int, default=6, help="floor measurements, alternated (0: none)")
    parser.add_argument(
        "--engines",
        default="",
        help="comma list of embedded, vllm: publish + update_weights into these real engines, the first "
        "the baseline of the ratios (opt-in: vLLM's CPU build starts in minutes)",
    )
    parser.add_argument("--engines-only", action="store_true", help="only the --engines section")
    parser.add_argument("--engine-versions", type=int, default=3, help="updates per engine before its restart")
    parser.add_argument("--tied", action="store_true", help="the --engines model ties its embeddings")
    parser.add_argument(
        "--vllm-dtype",
        choices=("float32", "bfloat16"),
        help="vLLM's --dtype (default: its own, bfloat16 for the bf16 checkpoint)",
    )
    parser.add_argument(
        "--vllm-reload-method",
        help="the worker method vLLM's update_weights calls through /collective_rpc (default: the launcher's; "
        "reload_weights: vLLM's own)",
    )
    args = parser.parse_args()
    kinds = [k for k in args.engines.split(",") if k]
    if any(k not in ("embedded", "vllm") for k in kinds) or len(set(kinds)) != len(kinds):
        parser.error(f"--engines takes embedded and/or vllm, got {args.engines!r}")
    if args.engines_only and not kinds:
        parser.error("--engines-only needs --engines")
    if args.engine_versions < 1:
        parser.error("--engine-versions must be positive")
    counts = [] if args.engines_only else [int(n) for n in args.hosts.split(",")]
    jax.config.update("jax_default_matmul_precision", "float32")
    print(f"jax {jax.__version__} on {jax.default_backend()}, lr {LR}, full checkpoint every {args.full_every}")
    with contextlib.ExitStack() as stack:
        scratch = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-weight-sync-")))
        addresses = stack.enter_context(host_processes(max(counts), scratch)) if counts else []
        for size in args.sizes.split(","):
            if kinds:
                engine_sync(size, kinds, args, scratch)
            if not counts:
                continue
            abstract = nnx.eval_shape(functools.partial(make_model, size))  # counted without allocating
            params = sum(x.size for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))
            print(f"\n{size}: {params / 1e6:.0f}M parameters")
            print("| hosts | fan-out | full sync s | full / raw copy | delta sync s | delta / raw copy | "
                  "changed | delta MB | learner link MB/step |")  # fmt: skip
            print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
            runs = [(n, True) for n in counts] + [(max(counts), False)] * (max(counts) > 1)
            for n, relay in runs:
                r = asyncio.run(run(size, addresses[:n], relay, args, scratch))
                link = r["delta_bytes"] * (1 if relay else n) / 1e6
                print(
                    f"| {n} | {'relay chain' if relay else 'direct'} | {r['sync_s']:.3f} | "
                    f"{r['sync_s'] / r['copy_s']:.2f}x | {r['delta_sync_s']:.3f} | "
                    f"{r['delta_sync_s'] / r['copy_s']:.2f}x | {100 * r['changed']:.2f}% | "
                    f"{r['delta_bytes'] / 1e6:.1f} | {link:.1f} |", flush=True,
                )  # fmt: skip
            print(f"raw copy of the full bf16 checkpoint: {r['copy_s']:.3f} s ({r['bytes'] / 1e6:.0f} MB); "
                  f"full publish {r['publish_s']:.3f} s, delta publish {r['delta_publish_s']:.3f} s")  # fmt: skip
            if args.install_repeats:
                h = host_install(size, scratch, args.install_repeats)
                print(f"host delta install: base read from disk {h['disk']:.3f} s, base held in memory "
                      f"{h['memory']:.3f} s ({h['memory'] / h['disk']:.2f}x); reload of the result "
                      f"{h['reload']:.3f} s, its digest {h['digest']:.3f} s (medians of {args.install_repeats}); "
                      f"tensors the delta changed hold {100 * h['rehashed']:.1f}% of the elements",
                      flush=True)  # fmt: skip
            if args.floor_repeats:
                f = floor(size, scratch, args.floor_repeats)
                ratio = {name: seconds / f["copy"] for name, seconds in f.items()}
                print(
                    f"floor (medians of {args.floor_repeats}, x one raw copy of {f['copy']:.3f} s): "
                    + ", ".join(f"{name} {f[name]:.3f} s ({ratio[name]:.2f}x)" for name in f if name != "copy")
                )
                full = ratio["export"] + ratio["rewrite"] + ratio["read"]
                print(f"  a delta step does at least export + compare: {ratio['export'] + ratio['compare']:.2f}x "
                      f"(target 0.3x); a full version export + rewrite + read: {full:.2f}x (target 2x), "
                      f"{full + ratio['digest']:.2f}x with its digest", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    jnp.zeros(())  # backend up before the hosts start competing for the cores
    sys.exit(main())
