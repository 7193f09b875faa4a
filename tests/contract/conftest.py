"""Engine contract suite: what the project relies on from any inference engine.

    pytest tests/contract --engine-url http://gpu-host:8000 \
        [--engine-reload-path DIR --engine-reload-method reload_weights_from_path]

Without --engine-url it starts the embedded JAX engine on a tiny random model.
The reload test needs a weights directory the engine can load whose weights
differ from the served ones (it is built for the embedded engine); against an
external engine it is skipped unless --engine-reload-path is given, and the
engine keeps the reloaded weights afterwards.

Run from the repository root with the path `tests/contract` so these options
are registered (pytest reads option hooks only from conftests it loads at
start-up); under a plain `pytest tests` the suite runs on the embedded engine.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from rollout_server.backends.client import SyncEngineClient


def _option(config: pytest.Config, name: str, default: str | None = None) -> str | None:
    return config.getoption(name, default=default)


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    from legorl_jax.models.demo_assets import build_tiny_hf_model

    base = build_tiny_hf_model(tmp_path_factory.mktemp("contract") / "model", seed=0)
    update = build_tiny_hf_model(tmp_path_factory.mktemp("contract") / "update", seed=1, tokenizer_dir=base)
    return base, update


@pytest.fixture(scope="session")
def engine_url(request: pytest.FixtureRequest) -> Iterator[str]:
    url = _option(request.config, "--engine-url")
    if url:
        yield url.rstrip("/")
        return
    from legorl_jax.serve.server import EmbeddedEngine

    base, _ = request.getfixturevalue("tiny_checkpoints")
    with EmbeddedEngine.start(base, max_slots=8, max_len=128, max_chunk=32) as running:
        yield running.url


@pytest.fixture(scope="session")
def reload_path(request: pytest.FixtureRequest) -> str:
    path = _option(request.config, "--engine-reload-path")
    if path:
        return path
    if _option(request.config, "--engine-url"):
        pytest.skip("external engine: pass --engine-reload-path to test weight reload")
    return str(request.getfixturevalue("tiny_checkpoints")[1])


@pytest.fixture(scope="session")
def client(engine_url: str, request: pytest.FixtureRequest) -> Iterator[SyncEngineClient]:
    method = _option(request.config, "--engine-reload-method", "reload_weights")
    sync = SyncEngineClient(engine_url, timeout=300, reload_method=method or "reload_weights")
    yield sync
    sync.close()
