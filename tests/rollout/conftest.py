"""Fixtures of the rollout-server suites beyond the shared ones (tests/conftest.py): a Docker client."""

from __future__ import annotations

from collections.abc import Iterator

import docker
import pytest


@pytest.fixture(scope="session")
def docker_client() -> Iterator[docker.DockerClient]:
    client = docker.from_env()
    yield client
    client.close()
