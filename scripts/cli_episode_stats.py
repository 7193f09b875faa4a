#!/usr/bin/env python
"""What one episode of each real harness CLI costs, in the demo's tokens and seconds.

Records oracle episodes (legorl_jax/demo/cli_demonstrations.py: each CLI in a
Docker sandbox, the real proxy and trial runner, graded) on generated demo
tasks and prints, per CLI and plan: the first prompt's length in tokens of the
demo tokenizer, model calls (side calls apart), tokens captured per episode
(every sequence) and wall time per episode. These size the CLI model's context
and the run's budget. Needs Docker and scripts/setup's CLI installs.

    .venv/bin/python scripts/cli_episode_stats.py [--harnesses a,b] [--tasks 2] [--tokenizer DIR]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from legorl_jax.core.config import DEFAULT_CONFIG, load_config  # noqa: E402
from legorl_jax.demo.cli_demonstrations import CLI_MOVES, CliEpisode, record_cli_demonstrations  # noqa: E402
from rollout_server.demo_families import demo_task_splits  # noqa: E402


def _table(episodes: list[CliEpisode]) -> str:
    rows = [
        "| harness | plan | episodes | graded as planned | first prompt (tokens) | model calls (+side) | "
        "tokens / episode | wall s / episode |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    keys = sorted({(e.harness, e.plan) for e in episodes})
    for harness, plan in keys:
        mine = [e for e in episodes if (e.harness, e.plan) == (harness, plan)]
        rows.append(
            f"| {harness} | {plan} | {len(mine)} | {sum(e.demonstration is not None for e in mine)} | "
            f"{max(e.first_prompt_tokens for e in mine)} | "
            f"{statistics.mean(e.model_calls - e.side_calls for e in mine):.1f} "
            f"(+{statistics.mean(e.side_calls for e in mine):.1f}) | "
            f"{statistics.mean(e.total_tokens for e in mine):,.0f} (max {max(e.total_tokens for e in mine):,}) | "
            f"{statistics.mean(e.wall_s for e in mine):.1f} |"
        )
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--harnesses", default=",".join(CLI_MOVES), help="comma-separated (default: every CLI)")
    parser.add_argument("--plans", default="direct,describe")
    parser.add_argument("--tasks", type=int, default=2, help="generated demo training tasks (one per family first)")
    parser.add_argument("--tokenizer", type=Path, help="an HF tokenizer directory (default: the base demo tokenizer)")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from legorl_jax.models.tokenizer import build_demo_tokenizer

    with tempfile.TemporaryDirectory(prefix="cli-stats-") as tmp:
        tokenizer_dir = args.tokenizer or build_demo_tokenizer(Path(tmp) / "tokenizer")
        train = demo_task_splits(load_config(DEFAULT_CONFIG).tasks.demo_variants)["train"]
        # One task of each family before a second of any.
        per_family = {"-".join(t.name.split("-")[:2]): t for t in reversed(train)}
        picked = (list(per_family.values()) + train)[: args.tasks]
        episodes = record_cli_demonstrations(
            AutoTokenizer.from_pretrained(tokenizer_dir),
            picked,
            args.harnesses.split(","),
            plans=args.plans.split(","),
        )
    print(f"tasks: {', '.join(t.name for t in picked)}; tokenizer: {args.tokenizer or 'base demo tokenizer'}")
    print(_table(episodes))
    for episode in episodes:
        if episode.problems:
            print(f"dropped: {episode.harness} / {episode.task} / {episode.plan}: {'; '.join(episode.problems)}")


if __name__ == "__main__":
    main()
