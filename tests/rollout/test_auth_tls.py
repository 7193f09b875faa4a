"""Bearer token and TLS on a real `RolloutServer`'s gRPC endpoint, the
`Fleet` client configured to pass both, and the refusal to listen beyond
loopback without a token.

One embedded engine serves the module (a subprocess, so every test's server
reaches it as an external engine); each test starts its own `RolloutServer`
with local sandboxes, which is cheap. Certificates are signed at test time.
"""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from legorl_jax.cli import build_parser
from legorl_jax.core.config import Config, ConfigError, EngineConfig, GrpcSecurityConfig, load_config
from legorl_jax.core.grpc_auth import ClientSecurity, client_security
from legorl_jax.fleet import Fleet, FleetError
from protos.legorl.v1 import rollout_pb2 as pb
from protos.legorl.v1 import rollout_pb2_grpc as pb_grpc
from rollout_server.backends.launch import start_engine
from rollout_server.server import RolloutServer, is_loopback

TOKEN_ENV = "LEGORL_TEST_ROLLOUT_TOKEN"
TOKEN = "s3cret-token-for-tests"


def self_signed(directory: Path, name: str) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 and localhost that is its own CA; returns (cert, key) paths."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = directory / f"{name}.crt", directory / f"{name}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return cert_path, key_path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from legorl_jax.models.demo_assets import build_tiny_hf_model

    return build_tiny_hf_model(tmp_path_factory.mktemp("model") / "tiny", hidden_size=32, intermediate_size=64)


@pytest.fixture(scope="module")
def engine_url(model_dir: Path) -> Iterator[str]:
    engine = start_engine(EngineConfig(port=0, max_batch=2, max_context=512), model_dir)
    try:
        yield engine.url
    finally:
        engine.stop()


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    directory = tmp_path_factory.mktemp("certs")
    server_cert, server_key = self_signed(directory, "server")
    other_ca, _ = self_signed(directory, "other")
    return {"cert": server_cert, "key": server_key, "other_ca": other_ca}


@pytest.fixture
def token_env(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    return TOKEN_ENV


def server_config(engine_url: str, **security: str) -> Config:
    overrides = [
        "engine.kind=external",
        f"engine.url={engine_url}",
        "sandbox.kind=local",
        "fleet.capacity_per_server=2",
        f"fleet.weights_location_roots=[{tempfile.gettempdir()}]",  # where the tests publish weights
    ]
    return load_config(None, overrides + [f"fleet.security.{k}={v}" for k, v in security.items()])


async def get_status(address: str, client: ClientSecurity) -> pb.ServerStatus:
    async with client.channel(address) as channel:
        stub = pb_grpc.RolloutServiceStub(channel)
        return await stub.GetStatus(pb.GetStatusRequest(), timeout=10, metadata=client.metadata)


async def status_code(address: str, client: ClientSecurity) -> grpc.StatusCode:
    try:
        await get_status(address, client)
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def bearer(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


def test_token_is_required_on_every_method(engine_url: str, model_dir: Path, token_env: str) -> None:
    async def main() -> None:
        server = RolloutServer(server_config(engine_url, token_env=token_env), model_dir)
        address = await server.start()
        try:
            refused = [
                (),  # no token
                bearer("wrong"),
                bearer(TOKEN + "x"),
                (("authorization", TOKEN),),  # right token, no scheme
                bearer(TOKEN) + bearer("wrong"),  # two answers: ambiguous, refused
            ]
            for metadata in refused:
                code = await status_code(address, ClientSecurity(metadata=metadata))
                assert code == grpc.StatusCode.UNAUTHENTICATED, metadata
            status = await get_status(address, ClientSecurity(metadata=bearer(TOKEN)))
            assert status.capacity == 2 and status.engine_healthy

            # A streaming method is refused too, before any trial could start.
            async with grpc.aio.insecure_channel(address) as channel:
                call = pb_grpc.RolloutServiceStub(channel).Rollout(
                    pb.RolloutRequest(tasks=[pb.TaskRef(task_id="t")], group_size=1), metadata=bearer("wrong")
                )
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    async for _ in call:
                        pass
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert (await get_status(address, ClientSecurity(metadata=bearer(TOKEN)))).in_flight_trials == 0
        finally:
            await server.stop(grace_s=5)

    asyncio.run(main())


def test_tls_server_needs_the_right_ca(engine_url: str, model_dir: Path, certs: dict[str, Path]) -> None:
    async def main() -> None:
        config = server_config(engine_url, tls_cert=str(certs["cert"]), tls_key=str(certs["key"]))
        server = RolloutServer(config, model_dir)
        address = await server.start()
        try:
            trusted = client_security(GrpcSecurityConfig(tls_ca_cert=str(certs["cert"])))
            assert (await get_status(address, trusted)).engine_healthy
            assert await status_code(address, ClientSecurity()) == grpc.StatusCode.UNAVAILABLE
            stranger = client_security(GrpcSecurityConfig(tls_ca_cert=str(certs["other_ca"])))
            assert await status_code(address, stranger) == grpc.StatusCode.UNAVAILABLE
        finally:
            await server.stop(grace_s=5)

    asyncio.run(main())


def test_fleet_with_token_and_ca_end_to_end(
    engine_url: str, model_dir: Path, certs: dict[str, Path], token_env: str, tmp_path: Path
) -> None:
    from legorl_jax.models.demo_assets import build_tiny_hf_model

    update = build_tiny_hf_model(tmp_path / "v1", hidden_size=32, intermediate_size=64, seed=1, tokenizer_dir=model_dir)
    server_side = {"token_env": token_env, "tls_cert": str(certs["cert"]), "tls_key": str(certs["key"])}
    client_side = GrpcSecurityConfig(token_env=token_env, tls_ca_cert=str(certs["cert"]))

    async def main() -> None:
        server = RolloutServer(server_config(engine_url, **server_side), model_dir)
        address = await server.start()
        try:
            async with Fleet([address], security=client_side) as fleet:
                assert fleet.statuses()[address] == {"alive": True, "capacity": 2, "busy": 0}
                assert await fleet.update_weights(1, str(update)) == {address: 1}
            assert server.service is not None and server.service.host.policy_version == 1

            no_token = GrpcSecurityConfig(tls_ca_cert=str(certs["cert"]))
            with pytest.raises(FleetError, match="UNAUTHENTICATED"):
                async with Fleet([address], security=no_token):
                    pass
        finally:
            await server.stop(grace_s=5)

    asyncio.run(main())


def test_unreadable_secrets_stop_startup_naming_the_field(
    model_dir: Path, certs: dict[str, Path], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    # engine.url points nowhere: the secrets must fail before anything is started.
    unreachable = "http://127.0.0.1:1"
    with pytest.raises(ConfigError, match=f"fleet.security.token_env: .*{TOKEN_ENV}"):
        asyncio.run(RolloutServer(server_config(unreachable, token_env=TOKEN_ENV), model_dir).start())
    missing = tmp_path / "nope.crt"
    with pytest.raises(ConfigError, match="fleet.security.tls_cert: cannot read .*nope.crt"):
        config = server_config(unreachable, tls_cert=str(missing), tls_key=str(certs["key"]))
        asyncio.run(RolloutServer(config, model_dir).start())
    not_pem = tmp_path / "token.txt"
    not_pem.write_text("hello\n")
    with pytest.raises(ConfigError, match="fleet.security.tls_ca_cert: .* is not a PEM file"):
        Fleet(["127.0.0.1:1"], security=GrpcSecurityConfig(tls_ca_cert=str(not_pem)))
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(ConfigError, match="fleet.security.token_file: .* is empty"):
        Fleet(["127.0.0.1:1"], security=GrpcSecurityConfig(token_file=str(empty)))
    with pytest.raises(ConfigError, match="tls_cert and tls_key go together"):
        server_config(unreachable, tls_cert=str(certs["cert"]))


def test_token_file_is_read_and_stripped(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text(f"  {TOKEN}\n")
    assert client_security(GrpcSecurityConfig(token_file=str(path))).metadata == bearer(TOKEN)


@pytest.mark.parametrize(
    ("address", "loopback"),
    [
        ("127.0.0.1:50051", True),
        ("127.8.9.10:1", True),
        ("localhost:0", True),
        ("[::1]:50051", True),
        ("unix:/tmp/legorl.sock", True),
        ("0.0.0.0:50051", False),
        ("[::]:50051", False),
        (":50051", False),
        ("10.0.0.5:50051", False),
        ("rollout-0.example.com:50051", False),
    ],
)
def test_loopback_addresses(address: str, loopback: bool) -> None:
    assert is_loopback(address) is loopback


def test_a_non_loopback_bind_needs_a_token(engine_url: str, model_dir: Path, token_env: str, tmp_path: Path) -> None:
    # The default listens on this host only.
    assert build_parser().parse_args(["rollout-server"]).address == "127.0.0.1:50051"
    # Refused before the engine is even asked (engine.url points nowhere), naming the fields to set.
    unreachable = "http://127.0.0.1:1"
    for address in ("0.0.0.0:0", "[::]:0"):
        with pytest.raises(ConfigError, match="fleet.security.token_env or fleet.security.token_file"):
            asyncio.run(RolloutServer(server_config(unreachable), model_dir, address=address).start())
    cli = subprocess.run(
        [
            str(Path(sys.executable).with_name("legorl")),
            "rollout-server",
            "--model",
            str(model_dir),
            "--address",
            "0.0.0.0:0",
            "--set",
            "engine.kind=external",
            "--set",
            f"engine.url={unreachable}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert cli.returncode == 2 and "refusing to listen on 0.0.0.0:0 without a bearer token" in cli.stderr, cli.stderr

    async def serves(server: RolloutServer, client: ClientSecurity) -> None:
        address = await server.start()
        try:
            port = address.rsplit(":", 1)[1]
            assert (await get_status(f"127.0.0.1:{port}", client)).engine_healthy
        finally:
            await server.stop(grace_s=5)

    # With a token it serves every interface; without one only when told, in so many words, to be insecure.
    asyncio.run(
        serves(
            RolloutServer(server_config(engine_url, token_env=token_env), model_dir, address="0.0.0.0:0"),
            ClientSecurity(metadata=bearer(TOKEN)),
        )
    )
    asyncio.run(
        serves(
            RolloutServer(server_config(engine_url), model_dir, address="0.0.0.0:0", insecure_no_auth=True),
            ClientSecurity(),
        )
    )
