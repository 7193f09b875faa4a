"""Proxy-only networking: the one door out of a sandbox is the token-capture proxy.

Design (measured on Docker 20.10 with iptables-nft):
- Trial containers join a Docker network created with `internal=True`: Docker
  gives it no route out, so the internet and other networks are unreachable.
- Inter-container traffic on it is off (`enable_icc=false`), so one trial
  cannot reach another.
- An internal bridge still leaves the *host* reachable through the bridge's
  gateway IP (packets to the host take the INPUT chain, which Docker does not
  filter). A host chain jumped to from INPUT for that bridge accepts TCP to the
  proxy port on the gateway IP and rejects everything else: the engine port,
  any other host service, and every other host address.
The proxy listens on the gateway IP (or 0.0.0.0); harnesses use
`http://<gateway>:<proxy_port>`. Needs root and iptables on the Docker host.
"""

from __future__ import annotations

import ipaddress
import logging
import shutil
import socket
import subprocess
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import docker
import docker.errors
from docker.models.networks import Network

from rollout_server.sandbox.base import SandboxError

_LABEL = "legorl.network"
_lock = threading.Lock()
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ProxyNetwork:
    name: str
    gateway: str
    proxy_port: int


def network_gateway(attrs: dict[str, Any]) -> str:
    """The host's IPv4 address on a Docker network, from `docker network inspect` attributes.

    A freshly started daemon may list its default bridge's IPAM config as only
    `{"Subnet": ...}`, without `Gateway`; Docker then gives the bridge the
    subnet's first host address, so that is the answer.
    """
    name = attrs.get("Name", "?")
    for config in attrs.get("IPAM", {}).get("Config") or []:
        if config.get("Gateway"):
            # Some daemon versions write the gateway with a prefix length ("172.18.0.1/16").
            gateway = ipaddress.ip_interface(config["Gateway"]).ip
            if gateway.version == 4:
                return str(gateway)
        elif config.get("Subnet"):
            subnet = ipaddress.ip_network(config["Subnet"], strict=False)
            if subnet.version == 4:
                return str(next(subnet.hosts()))
    raise SandboxError(f"network {name} has no IPv4 subnet, so no gateway address")


def _port_of(name: str) -> int | None:
    prefix, _, port = name.rpartition("-")
    return int(port) if prefix == "legorl-proxy" and port.isdigit() else None


def _names(proxy_port: int) -> tuple[str, str, str]:
    # Linux caps interface names at 15 chars and iptables chain names at 28.
    return f"legorl-proxy-{proxy_port}", f"lgrl{proxy_port}", f"LEGORL-PROXY-{proxy_port}"


def _iptables(*args: str, check: bool = True) -> bool:
    proc = subprocess.run(["iptables", "-w", "5", *args], capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise SandboxError(f"iptables {' '.join(args)} failed: {proc.stderr.strip()}")
    return proc.returncode == 0


def _install_rules(bridge: str, chain: str, gateway: str, proxy_port: int) -> None:
    if shutil.which("iptables") is None:
        raise SandboxError("proxy-only networking needs iptables on the Docker host (or set sandbox.network: none)")
    if not _iptables("-nL", chain, check=False):
        _iptables("-N", chain)
    _iptables("-F", chain)
    _iptables("-A", chain, "-p", "tcp", "-d", gateway, "--dport", str(proxy_port), "-j", "ACCEPT")
    # A reset instead of a silent drop: a probing agent fails fast rather than hanging its turn.
    _iptables("-A", chain, "-p", "tcp", "-j", "REJECT", "--reject-with", "tcp-reset")
    _iptables("-A", chain, "-j", "DROP")
    jump = ("INPUT", "-i", bridge, "-j", chain)
    if not _iptables("-C", *jump, check=False):
        _iptables("-I", *jump)


def _get_or_create(client: docker.DockerClient, name: str, bridge: str) -> Network:
    try:
        return client.networks.get(name)
    except docker.errors.NotFound:
        pass
    try:
        return client.networks.create(
            name,
            driver="bridge",
            internal=True,
            labels={_LABEL: "proxy_only"},
            options={"com.docker.network.bridge.name": bridge, "com.docker.network.bridge.enable_icc": "false"},
        )
    except docker.errors.APIError as exc:
        # Another process may have won the race to create it.
        try:
            return client.networks.get(name)
        except docker.errors.NotFound:
            raise SandboxError(f"cannot create network {name}: {exc}") from exc


def ensure_proxy_network(client: docker.DockerClient, proxy_port: int) -> ProxyNetwork:
    """Create (or reuse) the internal network for this proxy port and (re)install its host rules."""
    if not 0 < proxy_port < 65536:
        raise SandboxError(f"proxy port {proxy_port} out of range")
    name, bridge, chain = _names(proxy_port)
    with _lock:
        network = _get_or_create(client, name, bridge)
        network.reload()
        attrs = network.attrs
        if not attrs.get("Internal"):
            raise SandboxError(f"network {name} exists but is not internal; remove it (docker network rm {name})")
        gateway = network_gateway(attrs)
        bridge = attrs.get("Options", {}).get("com.docker.network.bridge.name", f"br-{network.short_id}")
        _install_rules(bridge, chain, gateway, proxy_port)
    return ProxyNetwork(name=name, gateway=gateway, proxy_port=proxy_port)


def remove_proxy_network(client: docker.DockerClient, proxy_port: int) -> None:
    """Tear the network and its host rules down; docker.errors.APIError while a container uses it."""
    name, bridge, chain = _names(proxy_port)
    with _lock:
        # The network first: while a container still uses it, removal fails and its rules stay.
        try:
            client.networks.get(name).remove()
        except docker.errors.NotFound:
            pass
        _iptables("-D", "INPUT", "-i", bridge, "-j", chain, check=False)
        _iptables("-F", chain, check=False)
        _iptables("-X", chain, check=False)


def _proxy_listening(gateway: str, port: int) -> bool:
    try:
        socket.create_connection((gateway, port), timeout=1.0).close()
        return True
    except OSError:
        return False


def _age_s(created: str, now: float) -> float:
    # Docker writes nanoseconds, more digits than datetime parses; whole seconds are enough here.
    try:
        stamp = datetime.strptime(created[:19], "%Y-%m-%dT%H:%M:%S").replace(tzinfo=timezone.utc)
    except ValueError:
        return 0.0
    return now - stamp.timestamp()


def reap_stale_networks(client: docker.DockerClient, min_age_s: float = 120.0) -> list[str]:
    """Remove proxy networks whose server is gone: no container attached and nothing listening
    on their proxy port. Each holds one of the daemon's few address pools (31 by default), so a
    crashed server's networks would otherwise soon stop every new one from being created.
    `min_age_s` spares a network whose server is still between creating it and listening."""
    removed: list[str] = []
    now = time.time()
    for entry in client.api.networks(filters={"label": _LABEL}):
        port = _port_of(entry.get("Name", ""))
        if port is None or _age_s(entry.get("Created", ""), now) < min_age_s:
            continue
        try:
            attrs = client.api.inspect_network(entry["Id"])
        except docker.errors.NotFound:
            continue
        try:
            gateway: str | None = network_gateway(attrs)
        except SandboxError:
            gateway = None
        if attrs.get("Containers") or (gateway and _proxy_listening(gateway, port)):
            continue
        try:
            remove_proxy_network(client, port)
        except docker.errors.APIError as exc:  # a trial joined it meanwhile: it is in use after all
            log.info("kept proxy network %s: %s", entry.get("Name"), exc)
            continue
        removed.append(entry.get("Name", ""))
    return removed
