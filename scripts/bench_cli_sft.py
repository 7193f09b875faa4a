#!/usr/bin/env python3
"""The CLI demo model's SFT step on real CLI episodes: with prefix sharing against without.

Records oracle episodes through real CLIs (`legorl_jax/demo/cli_demonstrations.py`:
each CLI in Docker, the real proxy, graded; needs scripts/setup's CLI installs)
on a few generated tasks, once, cached under `$LEGORL_CACHE/bench_cli_sft/`.
They are recorded under the base demo tokenizer, then a tokenizer of the CLI
spec's vocabulary is trained on their text, as the CLI model's build does, and
each episode's prompt and sampled runs are encoded with it run by run (the
build records them again instead: token boundaries at the runs' edges can
differ by a token; the shapes are the build's).

Then, per CLI, one step's batch as the CLI spec draws it (`sft.batch_size`
sequences of one CLI, `batch_by_config`) at the CLI model's shape (f32)
through the warm start's step (`legorl sft`'s `Learner` with the `nll` loss,
`legorl_jax/demo/sft.py` `learner_config`: the spec's buckets up to
`row_tokens`, its token budget, fitted micro-batches), twice:

- unshared (the baseline): every sequence whole;
- shared (the build's): prompts the batch's sequences share laid out once as
  a trie (`learner.share_prefixes`);

and prints per layout the best wall seconds of a whole step (pack, loss and
gradient, AdamW update; after a compiling one), the tokens computed and token
slots, `batch/shared_token_frac`, the loss, and the ratios.

    PYTHONPATH=. .venv/bin/python scripts/bench_cli_sft.py [--harnesses a,b,c] [--tasks 2] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from itertools import groupby
from pathlib import Path
from typing import Any

from legorl_jax.core.config import cache_root

EPISODES_FILE = "episodes.json"


def _runs(ids: list[int], mask: list[int]) -> list[tuple[int, list[int]]]:
    """(loss bit, ids) of every run of equal mask bits."""
    out, at = [], 0
    for bit, run in groupby(mask):
        n = len(list(run))
        out.append((bit, ids[at : at + n]))
        at += n
    return out


def record(out: Path, harnesses: list[str], tasks: int, plans: list[str]) -> None:
    """Oracle episodes through the CLIs under the base tokenizer, then re-encoded under a tokenizer of
    the CLI spec's vocabulary trained on their text; written to `out` as JSON."""
    import tempfile

    from transformers import AutoTokenizer

    from legorl_jax.demo.cli_demonstrations import record_cli_demonstrations
    from legorl_jax.demo.cli_model import CLI_DEMO_SPEC, cli_demo_tasks
    from legorl_jax.models.tokenizer import build_demo_tokenizer

    picked = cli_demo_tasks(1)[:tasks]
    work = Path(tempfile.mkdtemp())
    base_dir = build_demo_tokenizer(work / "base")
    base = AutoTokenizer.from_pretrained(base_dir)
    started = time.monotonic()
    episodes = record_cli_demonstrations(
        base, picked, harnesses, plans=plans, max_context=131072, max_tokens=CLI_DEMO_SPEC.max_tokens
    )
    record_s = time.monotonic() - started
    kept = [e for e in episodes if e.demonstration is not None]
    texts: list[str] = []
    for e in kept:
        assert e.demonstration is not None
        texts += [str(base.decode(list(ids))) for ids, _ in e.demonstration.sequences]
    cli_dir = build_demo_tokenizer(work / "cli", corpus=texts * 10, vocab_size=CLI_DEMO_SPEC.vocab_size)
    cli = AutoTokenizer.from_pretrained(cli_dir)
    rows = []
    for e in kept:
        assert e.demonstration is not None
        for ids, mask in e.demonstration.sequences:
            new_ids: list[int] = []
            new_mask: list[int] = []
            for bit, run in _runs(list(ids), list(mask)):
                enc = cli.encode(base.decode(run), add_special_tokens=False)
                new_ids += enc
                new_mask += [bit] * len(enc)
            rows.append(
                {
                    "harness": e.harness,
                    "task": e.task,
                    "plan": e.plan,
                    "ids": new_ids,
                    "mask": new_mask,
                    "base_tokens": len(ids),
                }
            )
    out.write_text(json.dumps({"record_s": record_s, "episodes": len(episodes), "kept": len(kept), "rows": rows}))


def _sequences(rows: list[dict[str, Any]]) -> list[Any]:
    import numpy as np

    from legorl_jax.rl.batching import TrainSequence

    return [
        TrainSequence(
            np.asarray(r["ids"], np.int32), np.asarray(r["mask"], bool), np.zeros(len(r["ids"]), np.float32), 1.0
        )
        for r in rows
    ]


def bench(rows: list[dict[str, Any]], repeats: int) -> dict[str, Any]:
    """One step's batch (`rows`, one CLI's) through the warm start's step, with prefix sharing
    (the CLI spec's) and without it (the baseline)."""
    import jax
    from bench_sft import cli_model

    from legorl_jax.core.config import MeshConfig, RLConfig
    from legorl_jax.demo.cli_model import CLI_DEMO_SPEC
    from legorl_jax.demo.demonstrations import Demonstration
    from legorl_jax.demo.sft import learner_config, prepare
    from legorl_jax.train.sft import sft_rl
    from legorl_jax.train.sharding import learner_mesh
    from legorl_jax.train.step import Learner

    sft = CLI_DEMO_SPEC.sft
    demos = [Demonstration(r["task"], r["harness"], r["plan"], ((tuple(r["ids"]), tuple(r["mask"])),)) for r in rows]
    # The build's layout for this batch: its buckets up to row_tokens (or the longest row, when longer).
    width = prepare(demos, pad_id=0).tokens.shape[1]
    shared = learner_config(sft.model_copy(update={"row_tokens": max(sft.row_tokens or width, width)}), width)
    seqs = _sequences(rows)
    out: dict[str, Any] = {
        "sequences": len(rows),
        "tokens": int(sum(len(r["ids"]) for r in rows)),
        "loss_tokens": int(sum(sum(r["mask"]) for r in rows)),
        "longest": int(max(len(r["ids"]) for r in rows)),
    }
    mesh = learner_mesh(MeshConfig())
    for name, cfg in (("unshared", shared.model_copy(update={"share_prefixes": False})), ("shared", shared)):
        learner = Learner(cli_model(), sft_rl(RLConfig()), cfg, mesh)
        seconds, losses = [], []
        for _ in range(repeats + 1):
            start = time.perf_counter()
            packed = learner.pack(seqs)
            losses.append(learner.update(packed).metrics["loss"])
            seconds.append(time.perf_counter() - start)
        out[name] = {
            "step_s": round(min(seconds[1:]), 3),
            "first_step_s": round(seconds[0], 2),
            "loss": losses[0],
            "calls": len(packed.micro_batches),
            "row_shapes": sorted({tuple(mb.tokens.shape) for mb in packed.micro_batches}),
            "computed_tokens": int(packed.stats["batch/computed_tokens"]),
            "token_slots": int(sum(mb.tokens.size for mb in packed.micro_batches)),
            "shared_token_frac": round(packed.stats["batch/shared_token_frac"], 4),
        }
        print(name, json.dumps(out[name]), flush=True)
        del learner
    out["time_ratio"] = round(out["shared"]["step_s"] / out["unshared"]["step_s"], 3)
    out["loss_rel_diff"] = abs(out["shared"]["loss"] / out["unshared"]["loss"] - 1)
    out["platform"] = jax.devices()[0].platform
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--harnesses", default="mini-swe-agent,opencode,codex")
    parser.add_argument("--tasks", type=int, default=2, help="Generated tasks recorded (each with both plans).")
    parser.add_argument("--repeats", type=int, default=2, help="Timed steps per layout after the compiling one.")
    parser.add_argument("--only", default="", help="Bench only these CLIs (comma-separated); default all recorded.")
    args = parser.parse_args()
    harnesses = args.harnesses.split(",")
    out = cache_root() / "bench_cli_sft" / f"{'-'.join(harnesses)}-{args.tasks}.json"
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        record(out, harnesses, args.tasks, ["direct", "describe"])
    recorded = json.loads(out.read_text())
    print(f"{recorded['kept']} of {recorded['episodes']} episodes kept, recorded in {recorded['record_s']:.0f} s")
    from legorl_jax.demo.cli_model import CLI_DEMO_SPEC

    results = {}
    for harness in args.only.split(",") if args.only else harnesses:
        rows = [r for r in recorded["rows"] if r["harness"] == harness][: CLI_DEMO_SPEC.sft.batch_size]
        if rows:
            print(harness, flush=True)
            results[harness] = bench(rows, args.repeats)
    print(json.dumps({"host_cpus": os.cpu_count(), **results}, indent=1))


if __name__ == "__main__":
    main()
