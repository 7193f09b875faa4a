"""The Kubernetes manifests under deploy/k8s/, checked offline: every document against the
API's JSON schemas (kubernetes-validate, strict: unknown fields fail), and the rollout fleet
against what `legorl rollout-server` actually parses, serves and reads."""

from __future__ import annotations

import argparse
import asyncio
import copy
import os
import re
import sys
from pathlib import Path, PurePosixPath
from typing import Any

import grpc
import kubernetes_validate
import pytest
import yaml

from legorl_jax.cli import SUBCOMMANDS, build_parser
from legorl_jax.commands import load_command_config
from legorl_jax.core.config import REPO_ROOT, Config, load_config
from legorl_jax.core.grpc_auth import BearerTokenInterceptor
from protos.legorl.v1 import rollout_pb2 as pb
from protos.legorl.v1 import rollout_pb2_grpc as pb_grpc

K8S_DIR = REPO_ROOT / "deploy" / "k8s"
MANIFESTS = sorted(K8S_DIR.glob("*.yaml")) + sorted(K8S_DIR.glob("*.yml"))
FLEET = K8S_DIR / "rollout-fleet.yaml"
# The newest Kubernetes release kubernetes-validate 1.37 ships schemas for.
K8S_VERSION = "1.37"

Doc = dict[str, Any]


def documents(path: Path) -> list[Doc]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def validate(doc: Doc) -> None:
    assert kubernetes_validate.validate(doc, K8S_VERSION, strict=True) == K8S_VERSION


# ------------------------------------------------------------------ schemas --


def test_manifests_exist() -> None:
    assert FLEET in MANIFESTS


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_every_document_matches_the_kubernetes_schema(path: Path) -> None:
    docs = documents(path)
    assert docs, f"{path.name} holds no document"
    for doc in docs:
        validate(doc)


def _statefulset() -> Doc:
    return next(doc for doc in documents(FLEET) if doc["kind"] == "StatefulSet")


@pytest.mark.parametrize(
    "break_it",
    [
        pytest.param(lambda s: s["spec"].update(replicas="16"), id="wrong-type"),
        pytest.param(lambda s: s["spec"]["template"]["spec"]["containers"][0].update(portz=[]), id="unknown-field"),
        pytest.param(lambda s: s["spec"].pop("selector"), id="missing-required"),
    ],
)
def test_the_validator_refuses_a_broken_manifest(break_it: Any) -> None:
    broken = copy.deepcopy(_statefulset())
    validate(copy.deepcopy(broken))  # the unbroken one passes, so the refusal below is the change's
    break_it(broken)
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(broken)


def test_an_unknown_kind_is_an_error_not_a_pass() -> None:
    with pytest.raises(kubernetes_validate.SchemaNotFoundError):
        validate({"apiVersion": "v1", "kind": "NoSuchKind", "metadata": {"name": "x"}})


# ------------------------------------------------------- the rollout fleet --


def _one(docs: list[Doc], kind: str) -> Doc:
    [doc] = [doc for doc in docs if doc["kind"] == kind]
    return doc


def _container(pod: Doc, name: str) -> Doc:
    [container] = [c for c in pod["containers"] if c["name"] == name]
    return container


def _made_by_header(pattern: str) -> re.Match[str]:
    """The manifest's header says how to make the ConfigMap and Secret it uses; `pattern` finds that line."""
    match = re.search(pattern, FLEET.read_text())
    assert match, f"the manifest's header no longer says how to make {pattern!r}"
    return match


def _expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' own substitution of $(VAR) in command and args, from the container's literal env values."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), text)


class Fleet:
    """The rollout fleet's manifest, and the config and arguments its server container runs with."""

    def __init__(self) -> None:
        docs = documents(FLEET)
        self.service, self.statefulset = _one(docs, "Service"), _one(docs, "StatefulSet")
        self.probe_script: str = _one(docs, "ConfigMap")["data"]["ready.py"]
        self.pod: Doc = self.statefulset["spec"]["template"]["spec"]
        self.server, self.dind = _container(self.pod, "rollout-server"), _container(self.pod, "dind")
        self.env = {e["name"]: e for e in self.server["env"]}
        literal = {name: e["value"] for name, e in self.env.items() if "value" in e}
        argv = [_expand(part, literal) for part in self.server["command"] + self.server["args"]]
        assert argv[:2] == ["legorl", "rollout-server"]
        self.args: argparse.Namespace = build_parser().parse_args(argv[1:])
        [mount] = [m for m in self.server["volumeMounts"] if m["mountPath"] == self.args.config]
        [volume] = [v for v in self.pod["volumes"] if v["name"] == mount["name"]]
        made = _made_by_header(rf"create configmap {volume['configMap']['name']} --from-file={mount['subPath']}=(\S+)")
        self.run_config_path: str = self.args.config
        self.run_config_source = REPO_ROOT / made.group(1)
        self.args.config = str(self.run_config_source)  # the repository file behind the mount
        self.config: Config = load_command_config(self.args)
        self.port = int(self.args.address.rsplit(":", 1)[1])

    def mounted(self, path: str) -> bool:
        """Whether `path` lies in one of the server container's volume mounts."""
        return any(PurePosixPath(path).is_relative_to(m["mountPath"]) for m in self.server["volumeMounts"])


@pytest.fixture(scope="module")
def fleet() -> Fleet:
    return Fleet()


def test_the_server_command_parses_with_the_real_cli(fleet: Fleet) -> None:
    assert fleet.args.command == "rollout-server"
    assert fleet.args._module == SUBCOMMANDS["rollout-server"][0]
    assert fleet.args.model and fleet.mounted(fleet.args.model)


def test_the_grpc_port_is_the_one_everything_names(fleet: Fleet) -> None:
    [port] = fleet.server["ports"]
    assert port["containerPort"] == fleet.port
    [service_port] = fleet.service["spec"]["ports"]
    assert service_port["port"] == fleet.port and service_port["targetPort"] == port["name"]
    for probe in ("startupProbe", "livenessProbe"):
        assert fleet.server[probe]["tcpSocket"]["port"] in (port["name"], fleet.port)
    assert f'"127.0.0.1:{fleet.port}"' in fleet.probe_script


def test_the_learner_addresses_each_pod_by_its_stable_name(fleet: Fleet) -> None:
    name, namespace = fleet.statefulset["metadata"]["name"], fleet.statefulset["metadata"]["namespace"]
    assert fleet.statefulset["spec"]["serviceName"] == fleet.service["metadata"]["name"]
    expected = [
        f"{name}-{i}.{fleet.service['metadata']['name']}.{namespace}.svc.cluster.local:{fleet.port}"
        for i in range(fleet.statefulset["spec"]["replicas"])
    ]
    assert fleet.config.fleet.servers == expected


def test_the_bearer_token_reaches_server_probe_and_learner(fleet: Fleet) -> None:
    """The server, its readiness probe (which reads the mounted run config alone) and the learner
    (the same file) must all name the token variable the pod fills from the Secret."""
    security = fleet.config.fleet.security
    assert security.token_env, "the server listens on every interface: it needs a token"
    secret = fleet.env[security.token_env]["valueFrom"]["secretKeyRef"]
    _made_by_header(rf"create secret generic {secret['name']} --from-literal={secret['key']}=")
    assert load_config(fleet.run_config_source).fleet.security == security, "--set changes what the probe reads"
    for path in (security.token_file, security.tls_cert, security.tls_key):
        assert path is None or fleet.mounted(path), f"{path} is not mounted in the server container"


def test_the_probe_answers_ready_with_the_token_and_not_without(fleet: Fleet, tmp_path: Path) -> None:
    """Runs the ConfigMap's ready.py against a gRPC server that requires the token, as the pod would."""
    token_env = fleet.config.fleet.security.token_env
    assert token_env
    probe_dir = next(m["mountPath"] for m in fleet.server["volumeMounts"] if m["name"] == "probe")
    assert fleet.server["readinessProbe"]["exec"]["command"][1:] == [f"{probe_dir}/ready.py", fleet.run_config_path]
    script = tmp_path / "ready.py"

    class Status(pb_grpc.RolloutServiceServicer):
        async def GetStatus(self, request: pb.GetStatusRequest, context: Any) -> pb.ServerStatus:
            return pb.ServerStatus(engine_healthy=True, draining=False)

    async def probe(token: str) -> tuple[int, str]:
        server = grpc.aio.server(interceptors=[BearerTokenInterceptor("right")])
        pb_grpc.add_RolloutServiceServicer_to_server(Status(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        script.write_text(fleet.probe_script.replace(f"127.0.0.1:{fleet.port}", f"127.0.0.1:{port}"))
        env = {**os.environ, token_env: token, "PYTHONPATH": str(REPO_ROOT)}
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                str(script),
                str(fleet.run_config_source),
                env=env,
                cwd=REPO_ROOT,
                stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.PIPE,
            )
            _, err = await proc.communicate()
            return await proc.wait(), err.decode()
        finally:
            await server.stop(None)

    rc, err = asyncio.run(probe("right"))
    assert rc == 0, err
    rc, err = asyncio.run(probe("wrong"))
    assert rc != 0 and "UNAUTHENTICATED" in err


def test_docker_host_is_the_dind_sidecars_socket(fleet: Fleet) -> None:
    socket = fleet.env["DOCKER_HOST"]["value"]
    assert f"--host={socket}" in fleet.dind["args"]
    path = socket.removeprefix("unix://")
    shared = [
        m["name"]
        for c in (fleet.server, fleet.dind)
        for m in c["volumeMounts"]
        if PurePosixPath(path).is_relative_to(m["mountPath"])
    ]
    assert len(shared) == 2 and shared[0] == shared[1], "the socket is not on a volume both containers mount"


def test_task_roots_and_security_context(fleet: Fleet) -> None:
    for root in fleet.config.tasks.train + fleet.config.tasks.eval:
        assert fleet.mounted(root), f"task root {root} is not mounted"
    context = fleet.server.get("securityContext", {})
    if fleet.config.sandbox.kind != "local" and fleet.config.sandbox.network == "proxy_only":
        # rollout_server/sandbox/network.py runs iptables in the pod's network namespace, as root.
        assert "NET_ADMIN" in context.get("capabilities", {}).get("add", [])
        assert context.get("runAsUser", 0) == 0 and not context.get("runAsNonRoot", False)
    assert fleet.dind["securityContext"]["privileged"] is True


def test_the_pod_outlives_the_drain(fleet: Fleet) -> None:
    # rollout_server: --drain-s for running trials, then about a minute to cancel the rest and exit.
    assert fleet.pod["terminationGracePeriodSeconds"] >= fleet.args.drain_s + 60


def test_gpus_match_vllms_tensor_parallel_size(fleet: Fleet) -> None:
    extra = fleet.config.engine.extra_args
    tensor_parallel = int(extra[extra.index("--tensor-parallel-size") + 1]) if "--tensor-parallel-size" in extra else 1
    resources = fleet.server["resources"]
    assert int(resources["limits"]["nvidia.com/gpu"]) == tensor_parallel
    assert fleet.config.engine.kind == "vllm"
