"""Fixtures of the rollout-server suites: a tiny model for the embedded engine,
the demo tokenizer for the scripted engine, and a Docker client."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import docker
import pytest
from transformers import AutoTokenizer

from legorl_jax.models.tokenizer import build_demo_tokenizer


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from legorl_jax.models.demo_assets import build_tiny_hf_model

    return build_tiny_hf_model(tmp_path_factory.mktemp("model") / "tiny")


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """All a host in front of the scripted engine loads: the proxy needs the tokenizer only."""
    return Path(build_demo_tokenizer(tmp_path_factory.mktemp("tokenizer")))


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(tokenizer_dir)


@pytest.fixture(scope="session")
def docker_client() -> Iterator[docker.DockerClient]:
    client = docker.from_env()
    yield client
    client.close()
