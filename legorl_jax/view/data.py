"""Reading a run directory for the viewer, incrementally and forgivingly.

A run appends to `metrics.jsonl` and `rollouts.jsonl` while it is viewed, and
a resumed run cuts them back. Each file is indexed by byte offset so a poll
reads only what was appended, and one trajectory is read by seeking to its
line. A malformed line is counted and skipped; a torn last line waits for its
newline.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

from legorl_jax.train.rollout_log import ROLLOUTS_FILE
from legorl_jax.train.run_log import METRICS_FILE

Record = dict[str, Any]
# Bytes before the read position remembered to notice a file rewritten in place (a resume's cut-back).
_TAIL = 64
_ERROR_CHARS = 200


class JsonlIndex:
    """The records of one JSON-lines file, read as it grows."""

    def __init__(self, path: Path, summarize: Callable[[Record], Record]) -> None:
        self.path = path
        self._summarize = summarize
        self._lock = threading.Lock()
        self._reset()
        self.epoch = 0  # bumped whenever the file was rewritten and the index started over

    def _reset(self) -> None:
        self.rows: list[Record] = []
        self.offsets: list[int] = []
        self.malformed = 0
        self._pos = 0
        self._tail = b""

    def _rewritten(self, f: BinaryIO, size: int) -> bool:
        """Whether the bytes already read changed: a shorter file, or other bytes before the read position."""
        if size < self._pos:
            return True
        f.seek(self._pos - len(self._tail))
        return f.read(len(self._tail)) != self._tail

    def refresh(self) -> None:
        with self._lock:
            try:
                f = self.path.open("rb")
            except (FileNotFoundError, NotADirectoryError):
                if self._pos:
                    self._reset()
                    self.epoch += 1
                return
            with f:
                size = f.seek(0, 2)
                if self._rewritten(f, size):
                    self._reset()
                    self.epoch += 1
                f.seek(self._pos)
                data = f.read(size - self._pos)
            end = data.rfind(b"\n") + 1  # a torn last line is read once its newline is there
            offset = self._pos
            for line in data[:end].splitlines(keepends=True):
                self._add(offset, line)
                offset += len(line)
            self._pos += end
            self._tail = (self._tail + data[:end])[-_TAIL:]

    def _add(self, offset: int, line: bytes) -> None:
        if not line.strip():
            return
        try:
            record = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError):
            record = None
        if not isinstance(record, dict):
            self.malformed += 1
            return
        self.rows.append(self._summarize(record))
        self.offsets.append(offset)

    def read(self, index: int) -> Record | None:
        """The full record at `index`, or None when there is none (or it changed meanwhile)."""
        with self._lock:
            if not 0 <= index < len(self.offsets):
                return None
            offset = self.offsets[index]
        try:
            with self.path.open("rb") as f:
                f.seek(offset)
                record = json.loads(f.readline())
        except (OSError, json.JSONDecodeError, UnicodeDecodeError):
            return None
        return record if isinstance(record, dict) else None


def summarize_rollout(record: Record) -> Record:
    """The columns of the rollouts table, and what the policy-lag curve needs."""
    sequences = [s for s in record.get("sequences") or [] if isinstance(s, dict)]
    advantages = [s["advantage"] for s in sequences if isinstance(s.get("advantage"), int | float)]
    versions = [s["policy_version"] for s in sequences if isinstance(s.get("policy_version"), int)]
    error = record.get("error")
    return {
        "step": record.get("step"),
        "kind": record.get("kind"),
        "task": record.get("task"),
        "harness": record.get("harness"),
        "status": record.get("status"),
        "reward": record.get("reward"),
        "error": error[:_ERROR_CHARS] if isinstance(error, str) else None,
        "advantage": advantages[0] if advantages else None,
        "sequences": len(sequences),
        "sampled_tokens": sum(e - s for seq in sequences for s, e in seq.get("spans") or []),
        "policy_version": min(versions) if versions else None,
    }


def policy_lag(rows: list[Record]) -> list[Record]:
    """Per train step, how many versions behind the learner its oldest and average sequence was.

    Step s trains on version s-1's weights; a sequence sampled by version v is s-1-v behind.
    """
    lags: dict[int, list[int]] = {}
    for row in rows:
        if row.get("kind") == "train" and isinstance(row.get("step"), int) and row.get("policy_version") is not None:
            lags.setdefault(row["step"], []).append(row["step"] - 1 - row["policy_version"])
    return [
        {"step": step, "policy_lag/max": max(values), "policy_lag/mean": sum(values) / len(values)}
        for step, values in sorted(lags.items())
    ]


class RunReader:
    """A run directory's metrics and rollouts, refreshed on every read."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = Path(run_dir)
        self.metrics = JsonlIndex(self.run_dir / METRICS_FILE, lambda r: r)
        self.rollouts = JsonlIndex(self.run_dir / ROLLOUTS_FILE, summarize_rollout)

    def state(self) -> Record:
        """What the page header shows: the run, whether its files are there, lines skipped."""
        self.metrics.refresh()
        self.rollouts.refresh()
        return {
            "run_dir": str(self.run_dir),
            "name": self.run_dir.name,
            "exists": self.run_dir.is_dir(),
            "has_metrics": self.metrics.path.is_file(),
            "has_rollouts": self.rollouts.path.is_file(),
            "malformed": {METRICS_FILE: self.metrics.malformed, ROLLOUTS_FILE: self.rollouts.malformed},
        }

    def metric_records(self, since: int, epoch: int | None) -> Record:
        """Metric records from `since` on (see `_page`), and the policy lag of every step so far."""
        self.rollouts.refresh()
        return {**_page(self.metrics, since, epoch), "derived": policy_lag(self.rollouts.rows)}

    def rollout_rows(self, since: int, epoch: int | None) -> Record:
        return _page(self.rollouts, since, epoch)

    def trajectory(self, index: int) -> Record | None:
        self.rollouts.refresh()
        return self.rollouts.read(index)


def _page(index: JsonlIndex, since: int, epoch: int | None) -> Record:
    """Rows from `since` on, so a poll carries only news; all of them when the client's epoch is stale."""
    index.refresh()
    if epoch != index.epoch:
        since = 0
    rows = index.rows[since:]
    total = since + len(rows)
    return {"epoch": index.epoch, "start": since, "rows": rows, "total": total, "malformed": index.malformed}
