"""What a run leaves behind and shows: `metrics.jsonl` (one JSON object per
step; eval records carry `eval_pass_rate`), TensorBoard event files, and a
one-line-per-step table on the console.

On resume the metrics file is cut back to the restored step (to nothing when
no checkpoint was restored), so a step that ran after the last checkpoint and
is run again appears once, not twice. The loop saves a step's checkpoint after
all of the step's lines, so a restored step's lines are all there.

Every record carries `time/run_s`: the run's wall seconds until it was written,
counted from the log's opening and, on resume, on from the last kept record
(`scripts/demo_figures.py` puts them in the README).
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from legorl_jax.core.files import replace_text

METRICS_FILE = "metrics.jsonl"
SFT_RUN_FILE = "sft.json"  # what marks a `legorl sft` run directory (its rollouts, filter and counts)
SFT_MODEL_DIR = "model"  # the fine-tuned HF directory inside a `legorl sft` run directory
RUN_TIME_KEY = "time/run_s"

# (header, metric key, format) of the console table.
COLUMNS: list[tuple[str, str, str]] = [
    ("step", "step", "{:>5.0f}"),
    ("reward", "reward/mean", "{:>7.3f}"),
    ("pass", "pass_rate", "{:>6.2f}"),
    ("groups", "groups/kept", "{:>6.0f}"),
    ("dropped", "groups/dropped_zero_variance", "{:>7.0f}"),
    ("envfail", "rollout/env_failures", "{:>7.0f}"),
    ("lp_diff", "logprob_diff_mean", "{:>8.4f}"),
    ("tok/s", "throughput/tokens_per_s", "{:>7.0f}"),
    ("roll_s", "time/rollout_s", "{:>7.1f}"),
    ("learn_s", "time/learner_s", "{:>7.1f}"),
]


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The records of a JSON-lines file, up to a line torn by a kill mid-write."""
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            break  # a line torn by a kill mid-write ends the usable record
    return records


def cut_back(path: Path, resume_step: int) -> list[dict[str, Any]]:
    """Keeps only the records of steps up to `resume_step` (and returns them): a resumed run writes the
    later ones again. All at once: a resume on a full disk must not cut the log it was keeping."""
    kept = [r for r in read_jsonl(path) if r.get("step", 0) <= resume_step]
    replace_text(path, "".join(json.dumps(r) + "\n" for r in kept))
    return kept


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    return read_jsonl(Path(run_dir) / METRICS_FILE)


class RunLog:
    def __init__(
        self,
        run_dir: Path,
        *,
        resume_step: int,
        tensorboard: bool,
        out: TextIO = sys.stdout,
        columns: list[tuple[str, str, str]] = COLUMNS,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.columns = columns  # the console table's (header, metric key, format)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / METRICS_FILE
        kept = cut_back(self.path, resume_step)
        # A resumed run's clock goes on from its last kept record (the time lost to the stop is not counted).
        self._run_s0 = max((r[RUN_TIME_KEY] for r in kept if isinstance(r.get(RUN_TIME_KEY), int | float)), default=0.0)
        self._opened = time.monotonic()
        self.out = out
        self._header_shown = False
        self._tb = None
        if tensorboard:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(str(self.run_dir / "tensorboard"), purge_step=resume_step + 1)

    def write(self, record: dict[str, Any]) -> None:
        run_s = round(self._run_s0 + time.monotonic() - self._opened, 1)
        clean = {k: _jsonable(v) for k, v in {**record, RUN_TIME_KEY: run_s}.items()}
        with self.path.open("a") as f:
            f.write(json.dumps(clean) + "\n")
            f.flush()
        if self._tb is not None:
            step = int(clean.get("step", 0))
            for key, value in clean.items():
                if isinstance(value, int | float) and key != "step" and math.isfinite(value):
                    self._tb.add_scalar(key, value, step)
            self._tb.flush()

    def table_row(self, record: dict[str, Any]) -> str:
        cells = []
        for _header, key, fmt in self.columns:
            value = record.get(key)
            width = len(fmt.format(0.0))
            cells.append(fmt.format(value) if isinstance(value, int | float) else "-".rjust(width))
        return " ".join(cells)

    def show(self, record: dict[str, Any], print_fn=None) -> None:
        emit = print_fn or (lambda text: print(text, file=self.out, flush=True))
        if not self._header_shown:
            widths = [len(fmt.format(0.0)) for _, _, fmt in self.columns]
            emit(" ".join(h.rjust(w) for (h, _, _), w in zip(self.columns, widths, strict=True)))
            self._header_shown = True
        emit(self.table_row(record))

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value
