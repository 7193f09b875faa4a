"""`harness_table.md` of a run: per harness configuration, the held-out results
of its first evaluation beside its last one (pass rate, tool calls and tokens
per episode, environment failures, prefix merging), as a markdown table a README
or an issue can quote as it is."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from legorl_jax.train.run_log import read_metrics

TABLE_FILE = "harness_table.md"
_PREFIX = "eval_harness/"
# (metric name, column heading, format) of the columns shown at both ends of the run.
_COLUMNS = (
    ("tool_calls_per_episode", "tool calls / episode", "{:.2f}"),
    ("prompt_tokens_per_episode", "prompt tokens / episode", "{:,.0f}"),
    ("completion_tokens_per_episode", "completion tokens / episode", "{:,.0f}"),
    ("env_failures", "env failures", "{:.0f}"),
    ("sequences_per_trajectory", "sequences / trajectory", "{:.2f}"),
    ("false_forks_per_trajectory", "false forks / trajectory", "{:.2f}"),
)


def _per_config(record: dict[str, Any]) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for key, value in record.items():
        if key.startswith(_PREFIX) and isinstance(value, int | float):
            config_id, _, name = key.removeprefix(_PREFIX).rpartition("/")
            out.setdefault(config_id, {})[name] = float(value)
    return out


def _pair(first: dict[str, float], last: dict[str, float], name: str, fmt: str) -> str:
    def one(values: dict[str, float]) -> str:
        return fmt.format(values[name]) if name in values else "–"

    return f"{one(first)} → {one(last)}"


def harness_table(records: list[dict[str, Any]]) -> str | None:
    """The table from a run's metrics records; None before a second evaluation."""
    evals = [r for r in records if r.get("kind") == "eval"]
    if len(evals) < 2:
        return None
    first, last = _per_config(evals[0]), _per_config(evals[-1])
    head = ["harness", "held-out pass rate", "change (points)", "trials"] + [c[1] for c in _COLUMNS]
    lines = [
        f"Held-out evaluation at step {evals[0]['step']} → step {evals[-1]['step']}.",
        "",
        "| " + " | ".join(head) + " |",
        "| " + " | ".join("---" for _ in head) + " |",
    ]
    for config_id in sorted(first.keys() | last.keys()):
        a, b = first.get(config_id, {}), last.get(config_id, {})
        change = f"{100 * (b['pass_rate'] - a['pass_rate']):+.1f}" if "pass_rate" in a and "pass_rate" in b else "–"
        cells = [
            f"`{config_id}`",
            _pair(a, b, "pass_rate", "{:.2f}"),
            change,
            _pair(a, b, "trials", "{:.0f}"),
            *(_pair(a, b, name, fmt) for name, _, fmt in _COLUMNS),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    overall = f"{evals[0].get('eval_pass_rate', 0.0):.2f} → {evals[-1].get('eval_pass_rate', 0.0):.2f}"
    lines += ["", f"All harnesses: {overall}."]
    return "\n".join(lines) + "\n"


def write_harness_table(run_dir: str | Path) -> Path | None:
    """Writes RUN_DIR/harness_table.md from its metrics; None when there is no table yet."""
    table = harness_table(read_metrics(Path(run_dir)))
    if table is None:
        return None
    out = Path(run_dir) / TABLE_FILE
    out.write_text(table, encoding="utf-8")
    return out
