"""Shared fixtures: the demo task families and demonstrations recorded once per
session (the demo tokenizer comes from tests/conftest.py)."""

from __future__ import annotations

from typing import Any

import pytest

from legorl_jax.demo.demonstrations import Demonstration, record_demonstrations
from rollout_server.demo_families import FAMILIES, generated_tasks
from rollout_server.harnesses.lego import LegoOptions
from rollout_server.tasks import Task

# The two lego configurations of configs/demo.yaml, and a third with the edit tools.
CONFIGS = (
    {"tools": "bash_only", "prompt": "terse"},
    {"tools": "minimal", "prompt": "guided"},
    {"tools": "edit_tools", "prompt": "guided"},
)


@pytest.fixture(scope="session")
def family_tasks(tmp_path_factory: pytest.TempPathFactory) -> list[Task]:
    """One training variant of every generated demo task family."""
    return generated_tasks(
        "train", sorted(FAMILIES), train_per_family=1, eval_per_family=0, cache_root=tmp_path_factory.mktemp("tasks")
    )


@pytest.fixture(scope="session")
def demos(tokenizer: Any, family_tasks: list[Task]) -> list[Demonstration]:
    """Every family x every configuration x every plan."""
    return record_demonstrations(tokenizer, family_tasks, [LegoOptions(**c) for c in CONFIGS])
