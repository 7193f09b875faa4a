"""Harnesses are given the proxy's model name, not the engine's: a launched engine serves its
weights path, which Claude Code refuses, and the name can appear in a harness's prompt."""

from __future__ import annotations

import pytest
from pydantic import ValidationError
from starlette.testclient import TestClient

from legorl_jax.core.config import ProxyConfig, load_config
from rollout_server.proxy.app import build_app
from rollout_server.proxy.engine_client import ProxyEngineClient
from rollout_server.proxy.render import ChatTemplate
from rollout_server.proxy.service import ProxyCore
from rollout_server.proxy.session import SessionSpec, SessionStore


def _listed(core: ProxyCore) -> list[str]:
    key = core.store.create(SessionSpec()).key
    with TestClient(build_app(core)) as client:
        reply = client.get(f"/s/{key}/v1/models", headers={"authorization": f"Bearer {key}"})
    assert reply.status_code == 200, reply.text
    return [card["id"] for card in reply.json()["data"]]


def test_models_lists_the_harness_facing_name_and_calls_keep_the_engines(template: ChatTemplate) -> None:
    engine = ProxyEngineClient("http://127.0.0.1:9", "/runs/demo/weights/v00000003")
    core = ProxyCore(template, engine, SessionStore(), max_context=512, model_name="policy")
    assert _listed(core) == ["policy"] and core.engine.model == "/runs/demo/weights/v00000003"
    unnamed = ProxyCore(template, ProxyEngineClient("http://127.0.0.1:9", "m"), SessionStore(), max_context=512)
    assert _listed(unnamed) == ["m"]


def test_the_configured_name_defaults_to_one_every_cli_takes() -> None:
    assert load_config().proxy.model_name == "policy"
    with pytest.raises(ValidationError, match="model_name"):
        ProxyConfig(model_name="Qwen/Qwen3-8B")
