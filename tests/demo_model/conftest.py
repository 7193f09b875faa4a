"""Shared fixtures: the base demo tokenizer and demonstrations recorded once per session."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from legorl_jax.models.tokenizer import build_demo_tokenizer
from legorl_jax.train.demonstrations import Demonstration, record_demonstrations
from rollout_server.harnesses.lego import LegoOptions
from rollout_server.tasks import demo_tasks

# The two lego configurations of configs/demo.yaml.
CONFIGS = ({"tools": "bash_only", "prompt": "terse"}, {"tools": "edit_tools", "prompt": "guided"})


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_demo_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(tokenizer_dir)


@pytest.fixture(scope="session")
def demos(tokenizer: Any) -> list[Demonstration]:
    """Every demo task x both demo configurations x both plans."""
    return record_demonstrations(tokenizer, demo_tasks(), [LegoOptions(**c) for c in CONFIGS])
