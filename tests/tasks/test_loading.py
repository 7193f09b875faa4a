"""Loading Harbor tasks: the demo set, directory trees, JSONL indexes, and errors that say where."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest

from rollout_server.tasks import DEMO_TASKS_DIR, TaskError, confined_task_dir, demo_tasks, load_task, load_tasks

GOOD_TOML = """
version = "1.0"
[verifier]
timeout_sec = 45.0
[agent]
timeout_sec = 200
[environment]
cpus = 2
memory_mb = 1024
"""


def make_task(root: Path, name: str = "t1", toml: str = GOOD_TOML, dockerfile: bool = True) -> Path:
    task = root / name
    (task / "tests").mkdir(parents=True)
    (task / "environment").mkdir()
    (task / "task.toml").write_text(toml)
    (task / "instruction.md").write_text("Do the thing.\n")
    (task / "tests" / "test.sh").write_text("echo 1 > /logs/verifier/reward.txt\n")
    if dockerfile:
        (task / "environment" / "Dockerfile").write_text("FROM legorl/base:bookworm\n")
    return task


def test_demo_tasks_are_complete() -> None:
    tasks = demo_tasks()
    assert len(tasks) >= 4
    for task in tasks:
        assert task.dockerfile is not None
        assert task.solution_dir is not None, f"{task.name} ships no solution"
        assert (task.tests_dir / "test.sh").is_file()
        assert task.instruction


def test_fields_are_read(tmp_path: Path) -> None:
    task = load_task(make_task(tmp_path))
    assert task.name == "t1"
    assert task.config.verifier.timeout_sec == 45.0
    assert task.config.agent.timeout_sec == 200.0
    assert (task.config.environment.cpus, task.config.environment.memory_mb) == (2.0, 1024)
    assert task.instruction == "Do the thing."
    assert task.solution_dir is None


def test_legacy_spellings_are_normalised(tmp_path: Path) -> None:
    toml = 'schema_version = "1.1"\n[task]\nname = "org/legacy"\n[environment]\nmemory = "4G"\n'
    task = load_task(make_task(tmp_path, toml=toml))
    assert task.name == "org/legacy"
    assert task.config.version == "1.1"
    assert task.config.environment.memory_mb == 4096


def test_unknown_keys_are_logged_not_fatal(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    toml = GOOD_TOML + "gpus = 1\n"  # lands in [environment]
    with caplog.at_level(logging.WARNING):
        load_task(make_task(tmp_path, toml=toml))
    assert "[environment].gpus" in caplog.text


@pytest.mark.parametrize(
    ("toml", "needle"),
    [
        ("[environment]\ncpus = -1\n", "[environment].cpus"),
        ("[verifier]\ntimeout_sec = 'soon'\n", "[verifier].timeout_sec"),
        ("[environment]\nmemory = 'lots'\n", "memory 'lots'"),
        ("[agent\n", "not valid TOML"),
    ],
)
def test_bad_task_toml_names_dir_file_and_field(tmp_path: Path, toml: str, needle: str) -> None:
    task_dir = make_task(tmp_path, toml=toml)
    with pytest.raises(TaskError) as info:
        load_task(task_dir)
    message = str(info.value)
    assert str(task_dir) in message and "task.toml" in message and needle in message


@pytest.mark.parametrize(
    ("breakage", "file"),
    [
        (lambda d: (d / "instruction.md").unlink(), "instruction.md"),
        (lambda d: (d / "instruction.md").write_text("  \n"), "instruction.md"),
        (lambda d: (d / "tests" / "test.sh").unlink(), "tests/test.sh"),
        (lambda d: (d / "environment" / "Dockerfile").unlink(), "environment/Dockerfile"),
        (lambda d: (d / "solution").mkdir(), "solution/solve.sh"),
        (lambda d: (d / "task.toml").unlink(), "task.toml"),
    ],
)
def test_missing_files_are_named(tmp_path: Path, breakage, file: str) -> None:  # type: ignore[no-untyped-def]
    task_dir = make_task(tmp_path)
    breakage(task_dir)
    with pytest.raises(TaskError) as info:
        load_task(task_dir)
    assert info.value.file == file and info.value.task_dir == task_dir


def test_prebuilt_image_replaces_dockerfile(tmp_path: Path) -> None:
    toml = '[environment]\ndocker_image = "legorl/base:bookworm"\n'
    task = load_task(make_task(tmp_path, toml=toml, dockerfile=False))
    assert task.dockerfile is None and task.config.environment.docker_image == "legorl/base:bookworm"


def test_tree_finds_every_task_and_skips_hidden(tmp_path: Path) -> None:
    make_task(tmp_path / "group_a", "one")
    make_task(tmp_path / "group_b", "two")
    make_task(tmp_path / ".cache", "stale")
    names = sorted(t.name for t in load_tasks([tmp_path]))
    assert names == ["one", "two"]


def test_jsonl_index_resolves_relative_paths(tmp_path: Path) -> None:
    shutil.copytree(DEMO_TASKS_DIR / "edit-config", tmp_path / "tasks" / "edit-config")
    make_task(tmp_path / "tasks", "mine")
    index = tmp_path / "index.jsonl"
    index.write_text(
        json.dumps({"path": "tasks/edit-config"})
        + "\n\n"
        + json.dumps({"path": str(tmp_path / "tasks" / "mine")})
        + "\n"
    )
    assert [t.name for t in load_tasks([index])] == ["edit-config", "mine"]


@pytest.mark.parametrize(
    ("line", "needle"), [("{not json", "not valid JSON"), ('{"dir": "x"}', '"path"'), ("[1]", '"path"')]
)
def test_bad_index_line_is_named(tmp_path: Path, line: str, needle: str) -> None:
    index = tmp_path / "idx.jsonl"
    index.write_text(json.dumps({"path": "a"}) + "\n" + line + "\n")
    with pytest.raises(TaskError) as info:
        load_tasks([index])
    assert info.value.file == "idx.jsonl:2" and needle in str(info.value)


def test_index_pointing_nowhere_fails(tmp_path: Path) -> None:
    index = tmp_path / "idx.jsonl"
    index.write_text(json.dumps({"path": "missing"}) + "\n")
    with pytest.raises(TaskError, match="not a directory"):
        load_tasks([index])


def test_duplicate_names_are_rejected(tmp_path: Path) -> None:
    toml = '[task]\nname = "same"\n'
    make_task(tmp_path, "a", toml=toml)
    make_task(tmp_path, "b", toml=toml)
    with pytest.raises(TaskError, match="also used by"):
        load_tasks([tmp_path])


def test_empty_tree_and_bad_source_fail(tmp_path: Path) -> None:
    with pytest.raises(TaskError, match="no task.toml"):
        load_tasks([tmp_path])
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(TaskError, match="neither a task directory"):
        load_tasks([tmp_path / "notes.txt"])


def test_unreadable_files_are_task_errors(tmp_path: Path) -> None:
    """Bad bytes are the task's fault, reported like any other (a request naming such a location gets
    INVALID_ARGUMENT, not a server fault)."""
    task = make_task(tmp_path, "bad-text")
    (task / "instruction.md").write_bytes(b"\xff\xfe not UTF-8")
    with pytest.raises(TaskError, match=f"task {task}: .: cannot read: 'utf-8' codec"):
        load_task(task)
    with pytest.raises(TaskError, match="cannot read: embedded null byte"):
        load_task(tmp_path / "nul\0byte")


def test_locations_are_confined_to_the_roots(tmp_path: Path) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    inside = make_task(root, "mine")
    theirs = make_task(outside, "theirs")
    (root / "link").symlink_to(theirs)
    roots = [root.resolve()]
    assert confined_task_dir(str(inside), roots) == inside.resolve()
    assert confined_task_dir(f"{root}/x/../mine", roots) == inside.resolve()
    for location in (str(theirs), f"{root}/../outside/theirs", str(root / "link"), "/etc", str(tmp_path)):
        with pytest.raises(TaskError, match="outside the task roots .*tasks.location_roots"):
            confined_task_dir(location, roots)
    with pytest.raises(TaskError, match="not a usable path"):
        confined_task_dir("/tmp/nul\0byte", roots)
