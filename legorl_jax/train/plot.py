"""`reward.png` of a run: training reward and pass rate per step, eval pass rate."""

from __future__ import annotations

from pathlib import Path

from legorl_jax.train.run_log import read_metrics


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    records = read_metrics(run_dir)
    if not records:
        raise FileNotFoundError(f"{run_dir / 'metrics.jsonl'}: no metrics to plot")
    out = Path(out) if out is not None else run_dir / "reward.png"
    train = [r for r in records if r.get("kind", "train") == "train"]
    evals = [r for r in records if r.get("eval_pass_rate") is not None]

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for key, label in (("reward/mean", "train reward"), ("pass_rate", "train pass rate")):
        points = [(r["step"], r[key]) for r in train if r.get(key) is not None]
        if points:
            ax.plot(*zip(*points, strict=True), marker=".", label=label)
    if evals:
        ax.plot([r["step"] for r in evals], [r["eval_pass_rate"] for r in evals], "s--", label="eval pass rate")
    ax.set_xlabel("step")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(run_dir.name)
    ax.grid(alpha=0.3)
    ax.legend(loc="best")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
