"""Bearer-token auth and TLS on the rollout gRPC endpoint, for both ends.

A server and its clients read the same `fleet.security` section. The server
gets TLS from `grpc.ssl_server_credentials` and checks the token in an
interceptor, before any handler runs; clients get TLS from
`grpc.ssl_channel_credentials` and send the token as `authorization: Bearer`
metadata on every call. Metadata rather than call credentials because grpc
refuses call credentials on a plaintext channel, and a token without TLS is a
legitimate choice on a private network.

Every file or variable that cannot be read is a `ConfigError` naming its field,
raised when the server or client is built, not at the first call.
"""

from __future__ import annotations

import dataclasses
import hmac
import logging
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc

from legorl_jax.core import log_redaction
from legorl_jax.core.config import ConfigError, GrpcSecurityConfig

log = logging.getLogger(__name__)

AUTH_KEY = "authorization"
_SECTION = "fleet.security"

Metadata = tuple[tuple[str, str], ...]


def _read_file(path: str, field: str) -> bytes:
    try:
        return Path(path).expanduser().read_bytes()
    except OSError as exc:
        raise ConfigError(f"{_SECTION}.{field}: cannot read {path}: {exc.strerror or exc}") from None


def _read_pem(path: str, field: str) -> bytes:
    data = _read_file(path, field)
    # grpc reports a malformed PEM only at handshake time, and vaguely; say it here.
    if b"-----BEGIN " not in data:
        raise ConfigError(f"{_SECTION}.{field}: {path} is not a PEM file")
    return data


def read_token(cfg: GrpcSecurityConfig) -> str | None:
    """The bearer token `cfg` names, or None when auth is off; from here on no log line shows it."""
    if cfg.token_env:
        token = os.environ.get(cfg.token_env, "").strip()
        if not token:
            raise ConfigError(f"{_SECTION}.token_env: environment variable {cfg.token_env} is unset or empty")
    elif cfg.token_file:
        token = _read_file(cfg.token_file, "token_file").decode("utf-8", errors="replace").strip()
        if not token:
            raise ConfigError(f"{_SECTION}.token_file: {cfg.token_file} is empty")
    else:
        return None
    log_redaction.add_secret(token)
    return token


# ------------------------------------------------------------------ server --

Continuation = Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]]

_HANDLER_KINDS: dict[tuple[bool, bool], Callable[..., grpc.RpcMethodHandler]] = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


async def _refuse(_request: Any, context: grpc.aio.ServicerContext) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Lets a call through only with `authorization: Bearer <token>`; the others
    end UNAUTHENTICATED before their handler runs."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

    def _authorized(self, details: grpc.HandlerCallDetails) -> bool:
        sent = [v for k, v in details.invocation_metadata or () if k == AUTH_KEY]
        value = sent[0] if len(sent) == 1 else ""
        presented = value.encode() if isinstance(value, str) else bytes(value)
        return hmac.compare_digest(presented, self._expected)

    async def intercept_service(
        self, continuation: Continuation, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        if handler is None or self._authorized(handler_call_details):
            return handler
        # A refusal of the method's own shape, so streaming calls end cleanly too.
        make = _HANDLER_KINDS[(handler.request_streaming, handler.response_streaming)]
        return make(
            _refuse,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )


@dataclasses.dataclass(frozen=True)
class ServerSecurity:
    credentials: grpc.ServerCredentials | None
    interceptors: tuple[grpc.aio.ServerInterceptor, ...]

    def describe(self) -> str:
        return f"{'TLS' if self.credentials else 'plaintext'}, {'token' if self.interceptors else 'no'} auth"


def server_security(cfg: GrpcSecurityConfig) -> ServerSecurity:
    token = read_token(cfg)
    credentials = None
    if cfg.tls_cert and cfg.tls_key:
        pair = (_read_pem(cfg.tls_key, "tls_key"), _read_pem(cfg.tls_cert, "tls_cert"))
        credentials = grpc.ssl_server_credentials([pair])
    elif token:
        log.warning("bearer token over plaintext gRPC: anyone on the network path can read it; set tls_cert/tls_key")
    return ServerSecurity(credentials, (BearerTokenInterceptor(token),) if token else ())


# ------------------------------------------------------------------ client --


@dataclasses.dataclass(frozen=True)
class Keepalive:
    """HTTP/2 pings on a client channel. A peer that holds its connection but answers nothing (a stopped
    or wedged host: its kernel still acknowledges TCP) is noticed only this way; without pings a streaming
    Rollout to it waits out its whole deadline (fleet.rpc_timeout_s, an hour)."""

    time_s: float = 20.0  # a ping after this long without one
    timeout_s: float = 10.0  # the transport is closed (calls fail UNAVAILABLE) when a ping goes unanswered this long

    def options(self) -> list[tuple[str, int]]:
        return [
            ("grpc.keepalive_time_ms", int(self.time_s * 1000)),
            ("grpc.keepalive_timeout_ms", int(self.timeout_s * 1000)),
            # gRPC 1.85 waits this long for a keepalive ping's answer (default a minute), not keepalive_timeout_ms.
            ("grpc.http2.ping_timeout_ms", int(self.timeout_s * 1000)),
            # A Rollout's client sends nothing after its request: by default it would stop pinging after two.
            ("grpc.http2.max_pings_without_data", 0),
        ]


# What every server of ours sets, so the clients' pings during a long silent stream are not answered with
# GOAWAY "too_many_pings" (gRPC's default allows one ping in 5 minutes without data).
SERVER_KEEPALIVE_OPTIONS = [
    ("grpc.http2.min_ping_interval_without_data_ms", 1000),
    ("grpc.http2.max_ping_strikes", 0),
]


@dataclasses.dataclass(frozen=True)
class ClientSecurity:
    credentials: grpc.ChannelCredentials | None = None
    metadata: Metadata = ()

    def channel(self, address: str, keepalive: Keepalive = Keepalive()) -> grpc.aio.Channel:
        options = keepalive.options()
        if self.credentials is None:
            return grpc.aio.insecure_channel(address, options=options)
        return grpc.aio.secure_channel(address, self.credentials, options=options)


def client_security(cfg: GrpcSecurityConfig) -> ClientSecurity:
    token = read_token(cfg)
    credentials = None
    if cfg.tls_ca_cert:
        credentials = grpc.ssl_channel_credentials(root_certificates=_read_pem(cfg.tls_ca_cert, "tls_ca_cert"))
    return ClientSecurity(credentials, ((AUTH_KEY, f"Bearer {token}"),) if token else ())
