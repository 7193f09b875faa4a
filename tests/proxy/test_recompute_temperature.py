"""recompute_logprobs against an engine that computes prompt logprobs at
temperature 1 whatever the request says (vLLM, and an external engine): a
session sampling at another temperature is refused when the admin API creates
it, and, made any other way, at the call that would recompute. An engine that
computes them at the request's temperature (the embedded one) serves both."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from legorl_jax.core.config import SamplingConfig
from rollout_server.proxy.app import build_app
from rollout_server.proxy.engine_client import ProxyEngineClient
from rollout_server.proxy.render import ChatTemplate
from rollout_server.proxy.service import ProxyCore
from rollout_server.proxy.session import SessionSpec, SessionStore

from .conftest import ADMIN_TOKEN, MAX_CONTEXT, Proxy
from .scripted_engine import ScriptedEngine, ServerThread
from .test_assembly import chat

ADMIN = {"authorization": f"Bearer {ADMIN_TOKEN}"}


@pytest.fixture(scope="module")
def vllm_proxy(_engine_server: tuple[ScriptedEngine, str], template: ChatTemplate) -> Iterator[Proxy]:
    """The proxy in front of the scripted engine, told it is vLLM's kind."""
    client = ProxyEngineClient(_engine_server[1], "scripted", unit_temperature_prompt_logprobs=True)
    core = ProxyCore(template, client, SessionStore(), max_context=MAX_CONTEXT)
    with ServerThread(build_app(core, keepalive_s=0.2, admin_token=ADMIN_TOKEN)) as server:
        yield Proxy(server.url, core)


def _create(proxy: Proxy, **spec: Any) -> httpx.Response:
    return httpx.post(f"{proxy.url}/admin/sessions", json=spec, headers=ADMIN, timeout=30)


def test_vllm_session_recomputing_at_another_temperature_is_refused_at_creation(
    vllm_proxy: Proxy, proxy: Proxy
) -> None:
    reply = _create(vllm_proxy, recompute_logprobs=True, sampling={"temperature": 0.7})
    assert reply.status_code == 400, reply.text
    message = reply.json()["error"]["message"]
    assert "sampling.temperature 0.7" in message and "temperature 1" in message
    assert "turn recompute_logprobs off" in message
    assert len(vllm_proxy.core.store) == 0
    # What it can serve: recompute at temperature 1, or no recompute at all.
    assert _create(vllm_proxy, recompute_logprobs=True, sampling={"temperature": 1.0}).status_code == 201
    assert _create(vllm_proxy, recompute_logprobs=False, sampling={"temperature": 0.7}).status_code == 201
    # The embedded engine's kind computes at the request's temperature.
    assert _create(proxy, recompute_logprobs=True, sampling={"temperature": 0.7}).status_code == 201


def _rewrite_history(proxy: Proxy, engine: ScriptedEngine) -> httpx.Response:
    """A session (made in the store, as the rollout service does) sampling at
    0.7 with recompute on: one call, then one whose history was rewritten."""
    spec = SessionSpec(recompute_logprobs=True, sampling=SamplingConfig(temperature=0.7))
    key = proxy.core.store.create(spec).key
    engine.push("First.", "Second.")
    chat(proxy, key, [{"role": "user", "content": "q"}])
    rewritten = [
        {"role": "user", "content": "q, edited"},
        {"role": "assistant", "content": "First."},
        {"role": "user", "content": "q2"},
    ]
    return httpx.post(
        f"{proxy.url}/v1/chat/completions",
        headers={"authorization": f"Bearer {key}"},
        json={"model": "m", "messages": rewritten},
        timeout=30,
    )


def test_vllm_call_that_would_recompute_at_another_temperature_is_refused(
    vllm_proxy: Proxy, engine: ScriptedEngine
) -> None:
    reply = _rewrite_history(vllm_proxy, engine)
    # A 400 the harness does not retry, naming the fix; the engine was never asked.
    assert reply.status_code == 400, reply.text
    assert "turn recompute_logprobs off" in reply.json()["error"]["message"]
    assert len(engine.log.bodies) == 1 and "prompt_logprobs" not in engine.log.bodies[0]


def test_embedded_engine_recomputes_at_the_sampling_temperature(proxy: Proxy, engine: ScriptedEngine) -> None:
    reply = _rewrite_history(proxy, engine)
    assert reply.status_code == 200, reply.text
    last = engine.log.bodies[-1]
    assert last["prompt_logprobs"] == 0 and last["temperature"] == 0.7
