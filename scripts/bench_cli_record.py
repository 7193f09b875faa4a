#!/usr/bin/env python3
"""Recording CLI demonstrations one at a time against several at once.

Records the same oracle episodes (`legorl_jax/demo/cli_demonstrations.py`: each
CLI in a Docker sandbox, the real proxy and trial runner, graded; needs Docker
and scripts/setup's CLI installs) once per concurrency setting, in one process,
under the base demo tokenizer, and prints per setting the wall seconds, the
ratio against the first sequential run, the load average around it, and
whether every episode's token ids (and grade) are the ones the first run
recorded; where they differ, the first line that does. Some CLIs write what
changes from run to run into the conversation (a date, a random id, a process
id): those episodes differ between two sequential runs as well. The default
set is 1 task x every CLI x the build's two plans; the default settings run
sequentially first and last, so a cold first run shows.

    PYTHONPATH=. .venv/bin/python scripts/bench_cli_record.py [--tasks 1] [--settings 1,2,3,4,1]
"""

from __future__ import annotations

import argparse
import difflib
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from legorl_jax.core.config import DEFAULT_CONFIG, load_config
from legorl_jax.demo.cli_demonstrations import CLI_MOVES, CliEpisode, record_cli_demonstrations
from rollout_server.demo_families import demo_task_splits


def _fingerprint(episode: CliEpisode) -> tuple[Any, ...]:
    """What must not depend on concurrency: the episode, its grade and the token ids captured."""
    demo = episode.demonstration
    return (episode.task, episode.harness, episode.plan, episode.reward, demo.sequences if demo else episode.problems)


def _first_difference(tokenizer: Any, mine: CliEpisode, theirs: CliEpisode) -> str:
    """The first line of the episode's text that differs from the other recording's."""
    texts = [
        [tokenizer.decode(list(ids)) for ids, _ in e.demonstration.sequences] if e.demonstration else list(e.problems)
        for e in (theirs, mine)
    ]
    before, after = ("\n".join(t).splitlines() for t in texts)
    diff = difflib.unified_diff(before, after, lineterm="", n=0)
    changed = [line for line in diff if line[:1] in "+-" and line[1:2] != line[:1]]
    return " / ".join(changed[:2])[:200]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--harnesses", default=",".join(CLI_MOVES), help="comma-separated (default: every CLI)")
    parser.add_argument("--plans", default="direct,describe")
    parser.add_argument("--tasks", type=int, default=1, help="generated demo training tasks")
    parser.add_argument("--settings", default="1,2,3,4,1", help="episodes at once, one recording each, in order")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    from transformers import AutoTokenizer

    from legorl_jax.models.tokenizer import build_demo_tokenizer

    tasks = demo_task_splits(load_config(DEFAULT_CONFIG).tasks.demo_variants)["train"][: args.tasks]
    harnesses, plans = args.harnesses.split(","), args.plans.split(",")
    print(f"{len(tasks)} task(s) x {len(harnesses)} CLIs x {len(plans)} plans; {os.cpu_count()} CPUs")
    with tempfile.TemporaryDirectory(prefix="bench-cli-record-") as tmp:
        tokenizer = AutoTokenizer.from_pretrained(build_demo_tokenizer(Path(tmp) / "tokenizer"))
        first: tuple[float, list[CliEpisode]] | None = None
        for concurrency in (int(c) for c in args.settings.split(",")):
            load = os.getloadavg()[0]
            started = time.monotonic()
            episodes = record_cli_demonstrations(tokenizer, tasks, harnesses, plans=plans, concurrency=concurrency)
            wall = time.monotonic() - started
            first = first or (wall, episodes)
            pairs = list(zip(episodes, first[1], strict=True))
            differ = [(e, f) for e, f in pairs if _fingerprint(e) != _fingerprint(f)]
            kept = sum(e.demonstration is not None for e in episodes)
            print(
                f"concurrency {concurrency}: {wall:.1f} s ({wall / first[0]:.2f} x the first run), "
                f"{kept}/{len(episodes)} kept, load {load:.1f} -> {os.getloadavg()[0]:.1f}, "
                f"token ids identical to the first run's in {len(pairs) - len(differ)}/{len(pairs)} episodes",
                flush=True,
            )
            for e, f in differ:
                print(f"    {e.task}/{e.harness}/{e.plan}: {_first_difference(tokenizer, e, f)}", flush=True)


if __name__ == "__main__":
    main()
