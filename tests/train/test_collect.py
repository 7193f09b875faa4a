"""`legorl collect`: a teacher's episodes through the rollout server, filtered and
written as a rollouts directory, from an external engine given by URL (served
here by the embedded engine, a real one)."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from legorl_jax.core.config import ConfigError
from legorl_jax.train.collect import Keep
from legorl_jax.view.data import RunReader
from protos.legorl.v1 import rollout_pb2 as pb
from rollout_server.tasks import DEMO_TASKS_DIR

TASKS = ("edit-config", "count-errors")


def _trial(task: str, reward: float | None, status: int = pb.TRIAL_STATUS_OK) -> pb.Trajectory:
    t = pb.Trajectory(task_id=task, status=status)
    if reward is not None:
        t.reward = reward
    return t


def test_the_filters_keep_graded_episodes_by_reward_and_cap_each_task_best_first() -> None:
    trials = [
        _trial("a", 0.0),
        _trial("a", 1.0),
        _trial("a", 0.5),
        _trial("b", 1.0),
        _trial("b", None),  # ungraded
        _trial("b", 1.0, pb.TRIAL_STATUS_ENGINE_ERROR),  # a reward on a broken trial is never kept
        _trial("c", 1.0),
        _trial("c", 0.0, pb.TRIAL_STATUS_CAP_EXCEEDED),  # graded: out of budget is the policy's doing
        _trial("c", 1.0, pb.TRIAL_STATUS_HARNESS_ERROR),
    ]
    rewards = lambda kept: [(t.task_id, t.reward) for t in kept]  # noqa: E731
    assert rewards(Keep().select(trials)) == [("a", 0.0), ("a", 1.0), ("a", 0.5), ("b", 1.0), ("c", 1.0), ("c", 0.0)]
    assert rewards(Keep(passing_only=True).select(trials)) == [("a", 1.0), ("b", 1.0), ("c", 1.0)]
    assert rewards(Keep(min_reward=0.5).select(trials)) == [("a", 1.0), ("a", 0.5), ("b", 1.0), ("c", 1.0)]
    assert rewards(Keep(per_task=2).select(trials)) == [("a", 1.0), ("a", 0.5), ("b", 1.0), ("c", 1.0), ("c", 0.0)]
    assert rewards(Keep(per_task=1).select(trials)) == [("a", 1.0), ("b", 1.0), ("c", 1.0)]
    with pytest.raises(ValueError, match="at least 1"):
        Keep(per_task=0)


def _collect(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "legorl_jax.cli", "collect", *args], capture_output=True, text=True, timeout=600
    )


@pytest.mark.docker
@pytest.mark.slow
def test_collect_from_an_engine_url_writes_a_rollouts_directory_the_viewer_reads(tmp_path: Path) -> None:
    from legorl_jax.models.demo_assets import build_tiny_hf_model
    from legorl_jax.serve.server import EmbeddedEngine

    model = build_tiny_hf_model(tmp_path / "teacher", seed=0, max_position_embeddings=8192)
    out = tmp_path / "episodes"
    args = [
        "--model", str(model), "--out", str(out), "--tasks", *(str(DEMO_TASKS_DIR / t) for t in TASKS),
        "--harness", '{"name": "lego"}', "--samples", "2", "--set", "rl.sampling.max_tokens=24",
    ]  # fmt: skip
    with EmbeddedEngine.start(model, max_slots=4, max_len=8192, max_chunk=256) as engine:
        done = _collect(*args, "--engine-url", engine.url)
        assert done.returncode == 0, done.stderr[-3000:]
        again = _collect(*args, "--engine-url", engine.url)  # nothing collected is ever overwritten
    assert again.returncode == 2 and "exists" in again.stderr and "Traceback" not in again.stderr

    manifest = json.loads((out / "collect.json").read_text())
    assert manifest == json.loads(done.stdout)
    assert manifest["trials"] == len(TASKS) * 2 and sum(manifest["statuses"].values()) == manifest["trials"]
    assert manifest["source"] == {"model": str(model), "engine": "external", "url": engine.url}
    assert "[collect] 4/4 trials" in done.stderr  # progress, group by group
    records = [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]
    # No filter: every graded episode (a random teacher passes none, but is graded).
    graded = sum(manifest["statuses"].get(s, 0) for s in ("ok", "timeout", "cap_exceeded"))
    assert len(records) == manifest["kept"] == graded > 0
    for record in records:
        assert record["kind"] == "collect" and record["reward"] is not None and record["task"] in TASKS
        for seq in record["sequences"]:
            sampled = sum(end - start for start, end in seq["spans"])
            assert sampled > 0 and len(seq["logprobs"]) == sampled and len(seq["ids"]) >= sampled
    reader = RunReader(out)
    assert reader.state()["has_rollouts"] and len(reader.rollout_rows(0, None)["rows"]) == len(records)

    filtered = _collect(*args, "--engine-url", "http://127.0.0.1:9", "--out", str(tmp_path / "none"), "--samples", "0")
    assert filtered.returncode == 2 and "--samples" in filtered.stderr


def _run(*argv: str) -> int:
    """A command in this process, as `legorl` runs it (without the process-wide set-up of `cli.main`)."""
    from legorl_jax.cli import build_parser

    args = build_parser().parse_args(argv)
    return int(importlib.import_module(args._module).run(args))


def test_a_chat_teachers_settings_are_checked_before_anything_starts(tmp_path: Path) -> None:
    collect = ["collect", "--model", str(tmp_path), "--out", str(tmp_path / "out")]
    with pytest.raises(ConfigError, match="--teacher-model: settings of a chat teacher, given with --engine-api"):
        _run(*collect, "--teacher-model", "t")
    with pytest.raises(ConfigError, match=r"--engine-api: give the teacher's server \(--engine-url\) and model"):
        _run(*collect, "--engine-api", "anthropic", "--engine-url", "http://t")
    teacher = ["--set", "engine.kind=openai_chat", "--set", "engine.url=http://t", "--set", "engine.teacher_model=m"]
    with pytest.raises(ConfigError, match="RL cannot train on them"):
        _run("train", *teacher)


# The teacher's bash tool call: the task's edit, with relative paths (a local sandbox runs in a copy of /app).
_SOLVE = "sed -i '/^\\[server\\]/,/^\\[/{s/^port = 8000$/port = 9090/;s/^debug = true$/debug = false/}' service.ini"


@pytest.mark.parametrize("api", ["openai_chat", "anthropic"])
def test_collect_from_a_chat_teacher_records_its_turns_as_the_student_writes_them(
    api: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tokenizer: Any
) -> None:
    from proxy.chat_teacher_server import TEACHER_KEY, teacher_server, teacher_tokenizer
    from rollout.stack import by_script, task_variant

    from legorl_jax.models.demo_assets import build_tiny_hf_model
    from legorl_jax.train.sft_data import check_tokenizer, read_sft_data

    student = build_tiny_hf_model(tmp_path / "student", max_position_embeddings=8192)  # the demo tokenizer
    task = task_variant(tmp_path / "tasks", "teach-edit")
    monkeypatch.setenv("TEACHER_KEY", TEACHER_KEY)
    args = [
        "collect", "--model", str(student), "--tasks", str(task), "--harness", '{"name": "lego"}',
        "--samples", "1", "--engine-api", api, "--teacher-model", "teacher", "--set", "sandbox.kind=local",
    ]  # fmt: skip
    with teacher_server(teacher_tokenizer(tmp_path / "teacher")) as (engine, url):
        engine.respond = by_script({"teach-edit": _SOLVE}, final="Edited.")
        out = tmp_path / "episodes"
        assert _run(*args, "--engine-url", url, "--api-key-env", "TEACHER_KEY", "--out", str(out)) == 0
        monkeypatch.setenv("WRONG_KEY", "wrong-key-0123456789")
        refused = tmp_path / "refused"
        assert _run(*args, "--engine-url", url, "--api-key-env", "WRONG_KEY", "--out", str(refused)) == 0

    manifest = json.loads((out / "collect.json").read_text())
    assert manifest["source"]["tokens"] == "re-rendered with the student's template"
    assert manifest["source"]["teacher_model"] == "teacher" and manifest["kept"] == 1
    (record,) = [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]
    assert record["reward"] == 1.0, record  # the teacher solved the task through the student's harness
    (seq,) = record["sequences"]
    assert seq["rerendered"] and set(seq["logprobs"]) == {0.0}
    written = [tokenizer.decode(seq["ids"][start:end]) for start, end in seq["spans"]]
    assert written[0].endswith('"arguments": ' + json.dumps({"command": _SOLVE}) + "}\n</tool_call><|im_end|>")
    assert written[-1].endswith("Edited.<|im_end|>")
    # In the student's tokenizer, so `legorl sft` takes them: every written token is a loss token.
    check_tokenizer(out, student)
    data = read_sft_data([out], Keep(), vocab_size=len(tokenizer))
    assert data.summary()["sft/loss_tokens"] == sum(end - start for start, end in seq["spans"])

    # A refused key: the trial is an engine error naming the teacher's answer, and nothing is kept.
    manifest = json.loads((refused / "collect.json").read_text())
    assert manifest["kept"] == 0 and manifest["statuses"] == {"engine_error": 1}, manifest
    (error,) = manifest["errors"]
    assert f"chat teacher ({api} at {url}) failed" in error and "401" in error and "wrong-key" not in error
