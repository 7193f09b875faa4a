"""scripts/demo_figures.py on a small synthetic run: the README's block between
its markers and the plot come from the run's logs, the rest is left alone."""

from __future__ import annotations

import json
from pathlib import Path

from script_module import load_script

REPO = Path(__file__).resolve().parents[2]
demo_figures = load_script("demo_figures")


def write_run(run: Path) -> None:
    def evaluation(step: int, rate: float, run_s: float) -> dict[str, object]:
        trials = {f"eval_harness/{c}/trials": 4.0 for c in ("a", "b")}
        return {"step": step, "kind": "eval", "eval_pass_rate": rate, "time/run_s": run_s, **trials}

    metrics = [evaluation(0, 0.25, 30.0)]
    for step, reward in zip(range(1, 5), (0.4, 0.2, 0.6, 0.7), strict=True):
        metrics.append({"step": step, "kind": "train", "reward/mean": reward, "time/run_s": 60.0 * step + 30})
        if step % 2 == 0:
            metrics.append(evaluation(step, {2: 0.625, 4: 0.5}[step], 60.0 * step + 45))
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in metrics))
    # Held-out episodes: at step 0 one of 8 called a tool; at step 2 six; at step 4 all.
    rollouts = [
        {"step": step, "kind": "eval", "metrics": {"tool_calls": int(i < acted)}}
        for step, acted in ((0, 1), (2, 6), (4, 8))
        for i in range(8)
    ]
    rollouts.append({"step": 1, "kind": "train", "metrics": {"tool_calls": 0}})  # not held out
    (run / "rollouts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rollouts))


def test_the_readme_block_and_plot_are_written_from_the_run(tmp_path: Path) -> None:
    write_run(tmp_path / "run")
    readme = tmp_path / "README.md"
    readme.write_text(f"# Demo\n\nbefore\n\n{demo_figures.START}\nhand-written numbers\n{demo_figures.END}\n\nafter\n")
    plot = tmp_path / "docs" / "demo_reward.png"
    plot.parent.mkdir()
    args = [str(tmp_path / "run"), "--readme", str(readme), "--plot", str(plot)]
    assert demo_figures.main(args) == 0
    text = readme.read_text()
    assert text.startswith("# Demo\n\nbefore\n\n") and text.endswith("\n\nafter\n")
    assert "hand-written" not in text
    block = text[text.index(demo_figures.START) : text.index(demo_figures.END)]
    assert block.splitlines()[1:] == [
        "| | held-out pass rate (8 episodes) | act share (held-out) |",
        "| --- | --- | --- |",
        "| step 0 | 0.25 | 0.12 |",
        "| step 2 (2 min 45 s into the run) | **0.62** | 0.75 |",
        "| step 4 (end) | 0.50 | 1.00 |",
        "",
        "Training reward: 0.40 / 0.20 (steps 1–2), 0.20–0.70 (steps 2–4).",
        "The run took 4 min 45 s of wall time (the model build before it not counted).",
    ]
    assert plot.read_bytes().startswith(b"\x89PNG")
    # Run again: the same README (the block is replaced, not added to).
    demo_figures.main(args)
    assert readme.read_text() == text


def test_the_readme_has_the_block() -> None:
    text = (REPO / "README.md").read_text()
    assert text.count(demo_figures.START) == 1 and text.index(demo_figures.START) < text.index(demo_figures.END)
    assert "docs/demo_reward.png" in text
