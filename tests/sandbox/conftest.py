"""Docker fixtures: one client and the cached base image for the whole session."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator

import docker
import pytest

from rollout_server.sandbox.base import SandboxSpec
from rollout_server.sandbox.docker import DockerSandbox
from rollout_server.sandbox.images import BASE_IMAGE, ensure_base_image
from rollout_server.sandbox.network import ProxyNetwork


@pytest.fixture(scope="session")
def docker_client() -> docker.DockerClient:
    client = docker.from_env(timeout=120)
    ensure_base_image(client)  # one-time debootstrap build when the cache is cold
    return client


@pytest.fixture
def make_box(docker_client: docker.DockerClient) -> Iterator[Callable[..., DockerSandbox]]:
    """Started sandboxes on the base image; all stopped at teardown."""
    made: list[DockerSandbox] = []

    def make(network: ProxyNetwork | None = None, **limits: object) -> DockerSandbox:
        spec = SandboxSpec(
            trial_id=f"t-{uuid.uuid4().hex[:8]}", environment_dir=None, docker_image=BASE_IMAGE, **limits
        )  # type: ignore[arg-type]
        box = DockerSandbox(spec, docker_client, network)
        made.append(box)
        box.start()
        return box

    yield make
    for box in made:
        box.stop()
