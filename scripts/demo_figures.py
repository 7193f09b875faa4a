#!/usr/bin/env python
"""The README's figures of the lego demo, from a finished run, not by hand.

Reads RUN_DIR's `metrics.jsonl` (held-out pass rates, training reward, the
run's wall time `time/run_s`) and `rollouts.jsonl` (which held-out episodes
called a tool), rewrites the README's block between the `demo-figures`
markers and redraws the plot (docs/demo_reward.png):

    ./scripts/demo && .venv/bin/python scripts/demo_figures.py runs/demo
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from legorl_jax.train.plot import plot_run  # noqa: E402
from legorl_jax.train.rollout_log import ROLLOUTS_FILE  # noqa: E402
from legorl_jax.train.run_log import RUN_TIME_KEY, read_jsonl, read_metrics  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
START, END = "<!-- demo-figures:start -->", "<!-- demo-figures:end -->"
_BLOCK = re.compile(re.escape(START) + ".*?" + re.escape(END), re.S)


def _duration(seconds: float) -> str:
    minutes, secs = divmod(round(seconds), 60)
    return f"{minutes} min {secs} s"


def act_shares(run_dir: Path) -> dict[int, float]:
    """Per evaluated step, the share of held-out episodes that called a tool."""
    episodes: dict[int, list[bool]] = {}
    for record in read_jsonl(run_dir / ROLLOUTS_FILE):
        if record.get("kind") == "eval":
            episodes.setdefault(record["step"], []).append((record.get("metrics") or {}).get("tool_calls", 0) > 0)
    return {step: sum(acted) / len(acted) for step, acted in episodes.items()}


def figures(run_dir: Path) -> str:
    """The block's Markdown: a row per held-out evaluation, the training reward, the run's wall time."""
    records = read_metrics(run_dir)
    evals = [r for r in records if r.get("kind") == "eval" and r.get("eval_pass_rate") is not None]
    train = [r for r in records if r.get("kind") == "train" and r.get("reward/mean") is not None]
    if not evals or not train:
        raise SystemExit(f"{run_dir}: no finished run (metrics.jsonl has no held-out evaluation or no train step)")
    episodes = sum(v for k, v in evals[0].items() if k.startswith("eval_harness/") and k.endswith("/trials"))
    acts = act_shares(run_dir)
    best = max(r["eval_pass_rate"] for r in evals)
    lines = [
        f"| | held-out pass rate ({episodes:.0f} episodes) | act share (held-out) |",
        "| --- | --- | --- |",
    ]
    for r in evals:
        step, rate = r["step"], r["eval_pass_rate"]
        when = "end" if r is evals[-1] else f"{_duration(r[RUN_TIME_KEY])} into the run" if RUN_TIME_KEY in r else ""
        label = f"step {step}" + (f" ({when})" if step and when else "")
        shown = f"**{rate:.2f}**" if rate == best and len(evals) > 1 else f"{rate:.2f}"
        act = f"{acts[step]:.2f}" if step in acts else "–"
        lines.append(f"| {label} | {shown} | {act} |")
    first, last = train[:2], train[-3:]
    rewards = " / ".join(f"{r['reward/mean']:.2f}" for r in first)
    low, high = min(r["reward/mean"] for r in last), max(r["reward/mean"] for r in last)
    lines += [
        "",
        f"Training reward: {rewards} (steps {first[0]['step']}–{first[-1]['step']}), "
        f"{low:.2f}–{high:.2f} (steps {last[0]['step']}–{last[-1]['step']}).",
    ]
    run_s = records[-1].get(RUN_TIME_KEY)
    if run_s is not None:
        lines.append(f"The run took {_duration(run_s)} of wall time (the model build before it not counted).")
    return "\n".join(lines)


def rewrite(readme: Path, block: str) -> None:
    text = readme.read_text()
    if not _BLOCK.search(text):
        raise SystemExit(f"{readme}: no {START} … {END} block to rewrite")
    readme.write_text(_BLOCK.sub(lambda _: f"{START}\n{block}\n{END}", text, count=1))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path, help="a finished demo run, e.g. runs/demo")
    parser.add_argument("--readme", type=Path, default=REPO / "README.md")
    parser.add_argument("--plot", type=Path, default=REPO / "docs" / "demo_reward.png")
    args = parser.parse_args(argv)
    rewrite(args.readme, figures(args.run_dir))
    plot_run(args.run_dir, args.plot)
    print(f"{args.readme} and {args.plot} now show {args.run_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
