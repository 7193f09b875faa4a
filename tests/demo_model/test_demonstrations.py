"""Demonstrations: real lego episodes through the real proxy, verified, with exact assistant masks."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
from conftest import CONFIGS

from legorl_jax.demo.demonstrations import (
    DESCRIBE_TEXT,
    EXPLORE_COMMAND,
    FAILING_PLANS,
    FINISH_TEXT,
    PLANS,
    Demonstration,
    DemonstrationError,
    plan_texts,
    record_demonstrations,
    solution_command,
    tool_call_text,
)
from rollout_server.harnesses.lego import LegoOptions, config_id
from rollout_server.tasks import Task, demo_tasks, load_task

IM_END = "<|im_end|>"
HEADER = "<|im_start|>assistant\n"


def masked_spans(ids: tuple[int, ...], mask: tuple[int, ...]) -> list[tuple[int, int]]:
    spans, start = [], None
    for i, bit in enumerate((*mask, 0)):
        if bit and start is None:
            start = i
        elif not bit and start is not None:
            spans.append((start, i))
            start = None
    return spans


def test_every_task_config_and_plan_scores_as_its_plan_should(
    demos: list[Demonstration], family_tasks: list[Task]
) -> None:
    # record_demonstrations keeps only episodes the verifier scored as their plan
    # should (1, or 0 for the weak teacher's habit), so all of them being here is the check.
    expected = {
        (task.name, config_id(LegoOptions(**c)), plan) for task in family_tasks for c in CONFIGS for plan in PLANS
    }
    assert {(d.task, d.config_id, d.plan) for d in demos} == expected
    assert len(demos) == len(expected)
    assert all(d.reward == (0.0 if d.plan in FAILING_PLANS else 1.0) for d in demos)


def test_masks_cover_exactly_the_assistant_turns(
    demos: list[Demonstration], tokenizer: Any, family_tasks: list[Task]
) -> None:
    tasks = {task.name: task for task in family_tasks}
    for demo in demos:
        # lego's history is append-only, so the proxy merges each episode into one sequence.
        assert len(demo.sequences) == 1
        ids, mask = demo.sequences[0]
        assert len(ids) == len(mask)
        options = LegoOptions(**next(c for c in CONFIGS if config_id(LegoOptions(**c)) == demo.config_id))
        expected = plan_texts(PLANS[demo.plan], options, solution_command(tasks[demo.task]))
        spans = masked_spans(ids, mask)
        assert [tokenizer.decode(list(ids[a:b])) for a, b in spans] == [text + IM_END for text in expected]
        for a, _ in spans:
            # Each masked span starts right after an assistant header, which itself is prompt (mask 0).
            assert tokenizer.decode(list(ids[:a])).endswith(HEADER)
        unmasked = tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if not m])
        assert unmasked.startswith("<|im_start|>system\n") and tasks[demo.task].instruction in unmasked
        assert unmasked.count(HEADER) == len(spans)


def test_plans_follow_the_tool_set() -> None:
    guided = plan_texts(PLANS["explore"], LegoOptions(tools="edit_tools"), "echo hi")
    assert guided == [
        tool_call_text("bash", {"command": EXPLORE_COMMAND}),
        tool_call_text("bash", {"command": "echo hi"}),
        tool_call_text("submit", {"summary": FINISH_TEXT}),
    ]
    assert plan_texts(PLANS["direct"], LegoOptions(tools="bash_only"), "x")[-1] == FINISH_TEXT
    minimal = plan_texts(PLANS["direct"], LegoOptions(tools="minimal", prompt="plan_first"), "x")
    assert len(minimal) == 3 and '"name": "run"' in minimal[1]
    assert plan_texts(PLANS["describe"], LegoOptions(tools="minimal"), "x") == [DESCRIBE_TEXT.format(command="x")]
    with pytest.raises(DemonstrationError, match="unknown plan moves"):
        plan_texts(("dance",), LegoOptions(), "x")


def test_solution_command_drops_shebang_and_comments() -> None:
    task = next(t for t in demo_tasks() if t.name == "edit-config")
    command = solution_command(task)
    assert not any(line.lstrip().startswith("#") for line in command.splitlines())
    assert command.startswith("set -euo pipefail") and "sed -i" in command


def copy_task(name: str, dest: Path) -> Path:
    src = next(t for t in demo_tasks() if t.name == name).root
    return Path(shutil.copytree(src, dest / name))


def test_a_solution_that_does_not_pass_is_rejected(tmp_path: Path, tokenizer: Any) -> None:
    root = copy_task("edit-config", tmp_path)
    (root / "solution" / "solve.sh").write_text("#!/bin/bash\necho doing nothing\n")
    with pytest.raises(DemonstrationError, match=r"no demonstration of \['edit-config'\] scored 1"):
        record_demonstrations(tokenizer, [load_task(root)], [LegoOptions(tools="bash_only")], plans=("direct",))


def test_a_task_without_solution_is_named(tmp_path: Path, tokenizer: Any) -> None:
    root = copy_task("count-errors", tmp_path)
    shutil.rmtree(root / "solution")
    with pytest.raises(DemonstrationError, match="count-errors: no solution/solve.sh"):
        record_demonstrations(tokenizer, [load_task(root)], [LegoOptions()])


def test_bad_arguments_are_clear_errors(tokenizer: Any) -> None:
    with pytest.raises(DemonstrationError, match="at least one task"):
        record_demonstrations(tokenizer, [], [LegoOptions()])
    with pytest.raises(DemonstrationError, match="plans must be"):
        record_demonstrations(tokenizer, demo_tasks(), [LegoOptions()], plans=("sprint",))
