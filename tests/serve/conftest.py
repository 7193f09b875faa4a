"""Fixtures of the engine tests: one tiny checkpoint per session, and one
embedded engine per module that needs a server."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

# Small enough that every compilation is quick, big enough for real batching;
# 8 slots give three row buckets (1, 4 and 8), so a lone row and padded rows are exercised.
ENGINE_KWARGS = {"max_slots": 8, "max_len": 96, "max_chunk": 32}


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from legorl_jax.models.demo_assets import build_tiny_hf_model

    return build_tiny_hf_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


@pytest.fixture(scope="session")
def other_weights_dir(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    """Same architecture and tokenizer, different random weights: a 'published' update."""
    from legorl_jax.models.demo_assets import build_tiny_hf_model

    return build_tiny_hf_model(tmp_path_factory.mktemp("tiny") / "update", seed=1, tokenizer_dir=tiny_model_dir)


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Iterator[object]:
    from legorl_jax.serve.server import EmbeddedEngine

    with EmbeddedEngine.start(tiny_model_dir, **ENGINE_KWARGS) as running:
        yield running
