"""Sandboxes for running tasks end to end: Docker (network off; tests/sandbox covers it) or local."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from rollout_server.sandbox.factory import SandboxFactory
from rollout_server.sandbox.images import ensure_base_image


@pytest.fixture(scope="session")
def docker_factory() -> Iterator[SandboxFactory]:
    factory = SandboxFactory(kind="docker", network="none")
    assert factory.client is not None
    ensure_base_image(factory.client)  # one-time debootstrap build when the cache is cold
    yield factory
    factory.close()
