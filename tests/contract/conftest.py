"""Engine contract suite: what the project relies on from any inference engine.

    pytest tests/contract --engine-url http://gpu-host:8000 [--engine-reload-path DIR]

Without --engine-url it runs three times on a tiny random model: against the
embedded JAX engine, against the real vLLM (set-up's CPU build, launched by
`start_engine` as a rollout host launches it), and against the same launch with
the vLLM stand-in (tests/serve/vllm_standin.py) as the executable, which mimics
0.33's per-token weight versions that the installable 0.32 lacks.
The reload test needs a weights directory the engine can load whose weights
differ from the served ones (built here for the local engines); against an
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

from legorl_jax.core.config import EngineConfig
from rollout_server.backends.client import EngineWatch, SyncEngineClient
from rollout_server.backends.launch import ManagedEngine


def _option(config: pytest.Config, name: str, default: str | None = None) -> str | None:
    return config.getoption(name, default=default)


# Room for a completion long enough that a weight update lands in its middle.
CONTEXT = 1024


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    from legorl_jax.models.demo_assets import build_tiny_hf_model

    # head_dim 32: the smallest vLLM's CPU attention kernels take (16 fails at the first request).
    base = build_tiny_hf_model(tmp_path_factory.mktemp("contract") / "model", seed=0, head_dim=32)
    update = build_tiny_hf_model(
        tmp_path_factory.mktemp("contract") / "update", seed=1, head_dim=32, tokenizer_dir=base
    )
    return base, update


@pytest.fixture(scope="session", params=["embedded", pytest.param("vllm", marks=pytest.mark.vllm), "vllm-standin"])
def engine(request: pytest.FixtureRequest) -> Iterator[tuple[str, EngineWatch | None, bool, bool]]:
    """(URL, launcher watch, whether prompt logprobs are fixed at temperature 1, whether it computes
    with the checkpoint's weights) of the engine under test."""
    url = _option(request.config, "--engine-url")
    if url:
        if request.param != "embedded":
            pytest.skip("--engine-url given: the suite runs once, against it")
        yield url.rstrip("/"), None, False, True
        return
    base, _ = request.getfixturevalue("tiny_checkpoints")
    if request.param == "embedded":
        from legorl_jax.serve.server import EmbeddedEngine

        with EmbeddedEngine.start(base, max_slots=8, max_len=CONTEXT, max_chunk=32) as running:
            yield running.url, None, False, True
        return
    from rollout_server.backends.launch import start_engine
    from rollout_server.backends.vllm import VllmOptions

    # float32 as the checkpoint is: vLLM on CPU would otherwise serve it in bfloat16.
    config = EngineConfig(kind="vllm", port=0, max_batch=8, max_context=CONTEXT, dtype="float32")
    options = (
        VllmOptions(executable=request.getfixturevalue("vllm_standin"))
        if request.param == "vllm-standin"
        else VllmOptions()
    )
    launched = start_engine(config, base, options)
    try:
        yield launched.url, launched, True, request.param == "vllm"
    finally:
        launched.stop()


@pytest.fixture(scope="session")
def real_model(engine: tuple[str, EngineWatch | None, bool, bool]) -> bool:
    """Whether the engine computes with the checkpoint's weights (every engine but the
    stand-in, whose "model" is a function of the weights' digest)."""
    return engine[3]


@pytest.fixture(scope="session")
def engine_url(engine: tuple[str, EngineWatch | None, bool, bool]) -> str:
    return engine[0]


@pytest.fixture(scope="session")
def reload_path(request: pytest.FixtureRequest) -> str:
    path = _option(request.config, "--engine-reload-path")
    if path:
        return path
    if _option(request.config, "--engine-url"):
        pytest.skip("external engine: pass --engine-reload-path to test weight reload")
    return str(request.getfixturevalue("tiny_checkpoints")[1])


@pytest.fixture(scope="session")
def client(engine: tuple[str, EngineWatch | None, bool, bool]) -> Iterator[SyncEngineClient]:
    url, watch, unit_temperature, _ = engine
    if isinstance(watch, ManagedEngine):  # launched here: its clients reload as its launcher says
        sync = watch.sync_client(timeout=300)
    else:
        sync = SyncEngineClient(url, timeout=300, watch=watch, unit_temperature_prompt_logprobs=unit_temperature)
    yield sync
    sync.close()
