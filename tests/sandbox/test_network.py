"""Proxy-only networking: the proxy port answers; other host ports, other trials and the outside do not."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator

import docker
import pytest

from rollout_server.sandbox.base import AGENT_USER, SandboxError
from rollout_server.sandbox.docker import DockerSandbox
from rollout_server.sandbox.network import ProxyNetwork, ensure_proxy_network, network_gateway, remove_proxy_network

MakeBox = Callable[..., DockerSandbox]

# Prints one line per target: OPEN <greeting> or FAIL <error>.
PROBE = """
import socket, sys
for target in sys.argv[1:]:
    host, port = target.rsplit(":", 1)
    s = socket.socket()
    s.settimeout(2)
    try:
        s.connect((host, int(port)))
        print(target, "OPEN", s.recv(5).decode())
    except OSError as exc:
        print(target, "FAIL", type(exc).__name__)
"""

# Another trial's service, greeting each connection.
PEER_SERVER = (
    'import socket; s = socket.create_server(("0.0.0.0", 8000)); [c.sendall(b"peer!") for c, _ in iter(s.accept, None)]'
)


def serve(greeting: bytes, host: str = "0.0.0.0") -> int:
    """A host TCP service (on every interface by default) that greets each connection; returns its port."""
    listener = socket.create_server((host, 0))

    def loop() -> None:
        while True:
            conn, _ = listener.accept()
            with conn:
                conn.sendall(greeting)

    threading.Thread(target=loop, daemon=True).start()
    return listener.getsockname()[1]


@pytest.fixture(scope="module")
def proxy_net(docker_client: docker.DockerClient) -> Iterator[ProxyNetwork]:
    port = serve(b"proxy")
    network = ensure_proxy_network(docker_client, port)
    yield network
    remove_proxy_network(docker_client, port)


def probe(box: DockerSandbox, *targets: str) -> dict[str, str]:
    result = box.exec(["python3", "-c", PROBE, *targets], timeout=60, user=AGENT_USER)
    assert result.ok, result
    return {line.split(" ", 1)[0]: line.split(" ", 1)[1] for line in result.stdout.splitlines()}


@pytest.mark.docker
def test_only_the_proxy_is_reachable(
    make_box: MakeBox, proxy_net: ProxyNetwork, docker_client: docker.DockerClient
) -> None:
    engine_port = serve(b"engin")
    box = make_box(network=proxy_net)
    other = make_box(network=proxy_net)
    other_ip = docker_client.containers.get(other.container_id).attrs["NetworkSettings"]["Networks"][proxy_net.name][
        "IPAddress"
    ]
    assert other.exec(["sh", "-c", f"setsid python3 -c '{PEER_SERVER}' > /dev/null 2>&1 &"], timeout=10).ok
    gateway = box.proxy_host
    # The host's address on Docker's default bridge: another way in to host services.
    default_bridge = network_gateway(docker_client.networks.get("bridge").attrs)
    seen = probe(
        box,
        f"{gateway}:{proxy_net.proxy_port}",
        f"{gateway}:{engine_port}",
        f"{default_bridge}:{engine_port}",
        f"{default_bridge}:{proxy_net.proxy_port}",
        f"{other_ip}:8000",
        "1.1.1.1:443",
    )
    assert seen[f"{gateway}:{proxy_net.proxy_port}"] == "OPEN proxy"
    closed = {
        target: outcome
        for target, outcome in seen.items()
        if not target.endswith(f":{proxy_net.proxy_port}") or not target.startswith(gateway)
    }
    assert all(outcome.startswith("FAIL") for outcome in closed.values()), closed
    assert probe(other, "127.0.0.1:8000") == {"127.0.0.1:8000": "OPEN peer!"}  # the peer's server was up


@pytest.mark.docker
def test_network_setup_is_idempotent(docker_client: docker.DockerClient, proxy_net: ProxyNetwork) -> None:
    again = ensure_proxy_network(docker_client, proxy_net.proxy_port)
    assert again == proxy_net


@pytest.mark.parametrize(
    ("config", "gateway"),
    [
        ([{"Subnet": "172.18.0.0/16", "Gateway": "172.18.0.1"}], "172.18.0.1"),
        # A freshly started daemon's default bridge: no Gateway key at all.
        ([{"Subnet": "172.17.0.0/16"}], "172.17.0.1"),
        ([{"Subnet": "10.9.8.0/24", "Gateway": "10.9.8.254/24"}], "10.9.8.254"),
        ([{"Subnet": "fd00::/64", "Gateway": "fd00::1"}, {"Subnet": "192.168.5.0/24"}], "192.168.5.1"),
    ],
)
def test_network_gateway_with_and_without_the_gateway_key(config: list[dict[str, str]], gateway: str) -> None:
    assert network_gateway({"Name": "n", "IPAM": {"Config": config}}) == gateway


@pytest.mark.parametrize("ipam", [{}, {"Config": None}, {"Config": [{"Subnet": "fd00::/64"}]}])
def test_network_gateway_without_an_ipv4_subnet_names_the_network(ipam: dict[str, object]) -> None:
    with pytest.raises(SandboxError, match="network n has no IPv4 subnet"):
        network_gateway({"Name": "n", "IPAM": ipam})
