"""Shared fixtures: the base demo tokenizer and demonstrations recorded once per session."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from legorl_jax.models.tokenizer import build_demo_tokenizer
from legorl_jax.train.demonstrations import Demonstration, record_demonstrations
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
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_demo_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(tokenizer_dir)


@pytest.fixture(scope="session")
def demos(tokenizer: Any, family_tasks: list[Task]) -> list[Demonstration]:
    """Every family x every configuration x every plan."""
    return record_demonstrations(tokenizer, family_tasks, [LegoOptions(**c) for c in CONFIGS])
