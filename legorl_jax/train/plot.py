"""`reward.png` of a run: training reward and pass rate per step above; below,
the held-out pass rate overall and one line per harness configuration."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from legorl_jax.train.run_log import read_metrics

EVAL_PREFIX = "eval_pass_rate/"
MARKERS = "osD^v<>phX*"


def harness_lines(evals: list[dict[str, Any]]) -> dict[str, list[tuple[int, float]]]:
    """Held-out pass rate per harness configuration: (step, rate) points in step order."""
    lines: dict[str, list[tuple[int, float]]] = {}
    for record in evals:
        for key, value in record.items():
            if key.startswith(EVAL_PREFIX) and isinstance(value, int | float):
                lines.setdefault(key.removeprefix(EVAL_PREFIX), []).append((record["step"], float(value)))
    return dict(sorted(lines.items()))


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    run_dir = Path(run_dir)
    records = read_metrics(run_dir)
    if not records:
        raise FileNotFoundError(f"{run_dir / 'metrics.jsonl'}: no metrics to plot")
    out = Path(out) if out is not None else run_dir / "reward.png"
    train = [r for r in records if r.get("kind", "train") == "train"]
    evals = [r for r in records if r.get("eval_pass_rate") is not None]
    per_harness = harness_lines(evals)

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    for key, label in (("reward/mean", "train reward"), ("pass_rate", "train pass rate")):
        points = [(r["step"], r[key]) for r in train if r.get(key) is not None]
        if points:
            top.plot(*zip(*points, strict=True), marker=".", label=label)
    top.set_title(f"{run_dir.name}: training")
    if evals:
        steps = [r["step"] for r in evals]
        bottom.plot(steps, [r["eval_pass_rate"] for r in evals], "k-", lw=2.5, marker="s", label="all harnesses")
    # One configuration's line would only repeat the overall one.
    if len(per_harness) > 1:
        colors = plt.get_cmap("tab10")
        for i, (config_id, points) in enumerate(per_harness.items()):
            bottom.plot(
                *zip(*points, strict=True),
                ls="--",
                marker=MARKERS[i % len(MARKERS)],
                color=colors(i % 10),
                label=config_id,
            )
    bottom.set_title("held-out pass rate")
    bottom.set_xlabel("step")
    bottom.xaxis.set_major_locator(MaxNLocator(integer=True))
    for ax in (top, bottom):
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            # Outside the axes: eight long configuration ids would cover the curves.
            ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small", frameon=False)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
