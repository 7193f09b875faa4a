"""Shared test plumbing.

Tests marked `docker`, `npm`, `browser`, `vllm`, `libtpu` or `gcs` need a real Docker
engine, Node.js harness CLIs, Chromium with chromedriver, vLLM (set-up installs its
CPU build in .cache/vllm-venv), libtpu (set-up: .cache/libtpu, with jax's CUDA plugin in
.cache/jax-cuda12) or the GCS emulator (gcp-storage-emulator, in the dev extra). Locally they skip with a reason
when those are missing; with CI=true they fail instead, so a CI run can never
pass by skipping them.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def _docker_available() -> str | None:
    if shutil.which("docker") is None:
        return "docker CLI not found"
    try:
        proc = subprocess.run(["docker", "info"], capture_output=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"docker info failed: {exc}"
    return None if proc.returncode == 0 else "no Docker daemon reachable (run ./scripts/setup as root)"


def _npm_available() -> str | None:
    return None if shutil.which("npm") and shutil.which("node") else "node/npm not found"


def pytest_addoption(parser: pytest.Parser) -> None:
    """Options of the engine contract suite (tests/contract); here, because pytest
    reads option hooks only from conftests loaded at start-up."""
    group = parser.getgroup("engine contract")
    group.addoption("--engine-url", default=None, help="base URL of the engine under test (default: embedded engine)")
    group.addoption("--engine-reload-path", default=None, help="HF weights directory the engine can reload")


def _browser_available() -> str | None:
    missing = [tool for tool in ("chromium", "chromedriver") if shutil.which(tool) is None]
    return f"{' and '.join(missing)} not found (./scripts/setup installs them as root)" if missing else None


def _vllm_available() -> str | None:
    from rollout_server.backends.vllm import VllmVersionError, check_vllm_version

    try:
        check_vllm_version()
    except VllmVersionError as exc:
        return str(exc)
    return None


def _gcs_emulator_available() -> str | None:
    import importlib.util

    return (
        None if importlib.util.find_spec("gcp_storage_emulator") else "gcp-storage-emulator not installed (dev extra)"
    )


def _libtpu_available() -> str | None:
    """libtpu, and beside it jax's CUDA plugin: the compilers `legorl plan` targets."""
    from legorl_jax.core.config import cache_root
    from legorl_jax.train.plan import CUDA_PLUGIN_DIR, LIBTPU_DIR

    for path in (cache_root() / LIBTPU_DIR / "libtpu", cache_root() / CUDA_PLUGIN_DIR / "jax_plugins"):
        if not path.is_dir():
            return f"no {path} (run ./scripts/setup)"
    return None


_CHECKS = {
    "docker": _docker_available,
    "npm": _npm_available,
    "browser": _browser_available,
    "vllm": _vllm_available,
    "libtpu": _libtpu_available,
    "gcs": _gcs_emulator_available,
}
_cache: dict[str, str | None] = {}


def pytest_runtest_setup(item: pytest.Item) -> None:
    for marker, check in _CHECKS.items():
        if item.get_closest_marker(marker) is None:
            continue
        if marker not in _cache:
            _cache[marker] = check()
        reason = _cache[marker]
        if reason is not None:
            if IN_CI:
                pytest.fail(f"CI=true and this test needs {marker}: {reason}", pytrace=False)
            pytest.skip(reason)


# Test assets many suites share, built once per session (imports inside: every test loads this file).


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo tokenizer (byte-level BPE with Qwen3's special tokens and chat template)."""
    from legorl_jax.models.tokenizer import build_demo_tokenizer

    return Path(build_demo_tokenizer(tmp_path_factory.mktemp("tokenizer")))


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random HF checkpoint with the demo tokenizer, for the embedded engine and the learner."""
    from legorl_jax.models.demo_assets import build_tiny_hf_model

    return build_tiny_hf_model(tmp_path_factory.mktemp("model") / "tiny")


@pytest.fixture(scope="session")
def vllm_standin(tmp_path_factory: pytest.TempPathFactory) -> str:
    """An executable named `vllm` that runs the vLLM stand-in (tests/serve/vllm_standin.py)
    with this interpreter: what the launcher starts where vLLM cannot be installed."""
    import sys

    script = Path(__file__).parent / "serve" / "vllm_standin.py"
    exe = tmp_path_factory.mktemp("bin") / "vllm"
    exe.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{script}" "$@"\n')
    exe.chmod(0o755)
    return str(exe)
