"""A resumed run rewrites its logs (cut back to the restored step): the rewrite lands whole or not
at all, so a kill or a failed write half-way through (tens of MB of `rollouts.jsonl`) cuts nothing."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from legorl_jax.core.files import replace_text
from legorl_jax.train.run_log import METRICS_FILE, RunLog


def test_replace_text_replaces_and_leaves_no_temp_file(tmp_path: Path) -> None:
    path = tmp_path / "f.txt"
    path.write_text("old")
    replace_text(path, "new")
    assert path.read_text() == "new" and [p.name for p in tmp_path.iterdir()] == ["f.txt"]


def test_a_cut_back_that_fails_half_way_keeps_the_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    metrics = tmp_path / METRICS_FILE
    metrics.write_text("".join(json.dumps({"step": s, "kind": "train"}) + "\n" for s in range(1, 11)))
    before = metrics.read_bytes()
    real_write_text = Path.write_text

    def dies_half_way(self: Path, text: str, *args: Any, **kwargs: Any) -> int:
        real_write_text(self, text[: len(text) // 2], *args, **kwargs)
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as patch:
        patch.setattr(Path, "write_text", dies_half_way)
        with pytest.raises(OSError, match="No space left"):
            RunLog(tmp_path, resume_step=5, tensorboard=False)
    assert metrics.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == [METRICS_FILE]  # no temp file left behind
    RunLog(tmp_path, resume_step=5, tensorboard=False)
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == [1, 2, 3, 4, 5]
