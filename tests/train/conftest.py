"""Learner tests: shared persistent XLA compilation cache for the session.

The tiny train step takes seconds to compile on CPU; tests (and the
subprocess workers, through `worker_env`) that build the same program reuse
one compilation instead of repeating it. The cache starts empty every session,
unless one is configured already (`./scripts/test --quick` keeps one across runs).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import jax
import pytest
from jax.experimental.compilation_cache import compilation_cache as jax_cache

sys.path.insert(0, str(Path(__file__).parent))

CACHE_OPTIONS = {
    "jax_compilation_cache_dir": None,
    "jax_persistent_cache_min_compile_time_secs": 0.0,
    "jax_persistent_cache_min_entry_size_bytes": 0,
}


@pytest.fixture(scope="session", autouse=True)
def compilation_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    previous = {k: getattr(jax.config, k) for k in CACHE_OPTIONS}
    configured = previous["jax_compilation_cache_dir"]
    cache = Path(configured) if configured else tmp_path_factory.mktemp("xla_cache")
    for key, value in {**CACHE_OPTIONS, "jax_compilation_cache_dir": str(cache)}.items():
        jax.config.update(key, value)
    jax_cache.reset_cache()  # JAX decides once per process whether a cache is in use
    yield cache
    for key, value in previous.items():
        jax.config.update(key, value)
    jax_cache.reset_cache()


@pytest.fixture
def worker_env(compilation_cache: Path) -> dict[str, str]:
    """Environment for `workers.py` subprocesses: the same compilation cache."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
    env.update(
        JAX_COMPILATION_CACHE_DIR=str(compilation_cache),
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
        JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
        PYTHONPATH=str(Path(__file__).resolve().parents[2]),
    )
    return env
