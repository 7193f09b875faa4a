"""No secret reaches a log line: a real trial (lego on a local sandbox, the
scripted engine, gRPC with a bearer token) logged at DEBUG leaves neither a
proxy session key nor the gRPC token in any record."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import grpc
import pytest

from legorl_jax.demo.demonstrations import tool_call_text
from protos.legorl.v1 import rollout_pb2 as pb
from protos.legorl.v1 import rollout_pb2_grpc as pb_grpc
from rollout_server.proxy.session import SessionStore
from rollout_server.server import RolloutServer

from .stack import engine_on_host, lego, scripted_server_config

HASHFLIP = Path(__file__).resolve().parents[1] / "loop" / "hashflip"
TOKEN_ENV = "LEGORL_TEST_LOG_SECRETS_TOKEN"
TOKEN = "grpc-token-never-logged"


def test_a_trial_logged_at_debug_shows_no_secret(
    model_dir: Path, tokenizer: Any, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    keys: list[str] = []
    create = SessionStore.create

    def recorded(self: SessionStore, *args: Any, **kwargs: Any) -> Any:
        session = create(self, *args, **kwargs)
        keys.append(session.key)
        return session

    monkeypatch.setattr(SessionStore, "create", recorded)
    caplog.set_level(logging.DEBUG)
    request = pb.RolloutRequest(
        request_id="secrets",
        tasks=[pb.TaskRef(location=str(HASHFLIP))],
        harness_configs=[lego("bash_only")],
        group_size=2,
    )

    async def main() -> list[pb.Trajectory]:
        server = RolloutServer(config, model_dir)
        address = await server.start()
        try:
            async with grpc.aio.insecure_channel(address) as channel:
                stub = pb_grpc.RolloutServiceStub(channel)
                return [t async for t in stub.Rollout(request, metadata=(("authorization", f"Bearer {TOKEN}"),))]
        finally:
            await server.stop(grace_s=10)

    with engine_on_host(tokenizer) as (engine, _, port):
        engine.respond = lambda p: (
            "Done." if p.count("<|im_start|>assistant") > 1 else tool_call_text("bash", {"command": "true"})
        )
        config = scripted_server_config(
            f"http://127.0.0.1:{port}",
            **{
                "sandbox.kind": "local",
                "tasks.location_roots": f"[{HASHFLIP.parent}]",
                "fleet.security.token_env": TOKEN_ENV,
            },
        )
        trajectories = asyncio.run(main())
    assert [t.status for t in trajectories] == [pb.TRIAL_STATUS_OK] * 2
    assert len(keys) == 2
    text = "\n".join(caplog.text.splitlines() + [r.getMessage() for r in caplog.records])
    # The log is not empty: the harness's client logged its calls (their URLs, keys blanked).
    assert "/s/<redacted>/v1/" in text
    for secret in [*keys, TOKEN]:
        assert secret not in text
