"""Fixtures of the model tests: tiny HF checkpoints built once per session."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from tiny_hf import build_tiny_hf


@pytest.fixture(scope="session")
def tiny_hf_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """name -> directory of a tiny HF checkpoint, built once per session."""
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            built[name] = build_tiny_hf(name, tmp_path_factory.mktemp(f"hf_{name}"))
        return built[name]

    return get
