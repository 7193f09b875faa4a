"""A host's proxy network lives as long as its server: removed when the sandbox
factory closes, and reaped at the next start-up when its server died without
closing (each network holds one of the daemon's few address pools)."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import docker
import docker.errors
import pytest

from rollout_server.sandbox.factory import SandboxFactory
from rollout_server.sandbox.network import ensure_proxy_network, reap_stale_networks, remove_proxy_network

pytestmark = pytest.mark.docker


def exists(client: docker.DockerClient, name: str) -> bool:
    try:
        client.networks.get(name)
        return True
    except docker.errors.NotFound:
        return False


@pytest.fixture
def listening_port() -> Iterator[int]:
    """A port with a live listener on every host address, as a running proxy has."""
    with socket.create_server(("0.0.0.0", 0)) as sock:
        yield sock.getsockname()[1]


@pytest.fixture
def idle_port() -> int:
    """A port nobody listens on, as a dead server's."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_closing_the_factory_removes_its_network(docker_client: docker.DockerClient, idle_port: int) -> None:
    factory = SandboxFactory("docker", "proxy_only", proxy_port=idle_port)
    assert factory.network is not None
    name = factory.network.name
    assert exists(docker_client, name)
    factory.close()
    assert not exists(docker_client, name)


def test_only_networks_of_gone_servers_are_reaped(
    docker_client: docker.DockerClient, idle_port: int, listening_port: int
) -> None:
    dead = ensure_proxy_network(docker_client, idle_port)
    live = ensure_proxy_network(docker_client, listening_port)
    try:
        assert dead.name not in reap_stale_networks(docker_client, min_age_s=3600)  # too young to judge
        removed = reap_stale_networks(docker_client, min_age_s=0)
        assert dead.name in removed and not exists(docker_client, dead.name)
        assert live.name not in removed and exists(docker_client, live.name)
    finally:
        remove_proxy_network(docker_client, idle_port)
        remove_proxy_network(docker_client, listening_port)
