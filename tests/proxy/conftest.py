"""Fixtures: the chat template of the demo tokenizer (tests/conftest.py), a
scripted test engine and the proxy, each served by uvicorn on a local port for
the whole test session."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from rollout_server.proxy.app import build_app
from rollout_server.proxy.engine_client import ProxyEngineClient
from rollout_server.proxy.render import ChatTemplate, Prompt
from rollout_server.proxy.service import ProxyCore
from rollout_server.proxy.session import SessionStore

from .scripted_engine import ScriptedEngine, ServerThread

ADMIN_TOKEN = "admin-test-token"
MAX_CONTEXT = 4096


@pytest.fixture(scope="session")
def template(tokenizer: Any) -> ChatTemplate:
    return ChatTemplate(tokenizer)


@pytest.fixture(autouse=True)
def incremental_renders(template: ChatTemplate, monkeypatch: pytest.MonkeyPatch) -> list[Prompt]:
    """Every render in every proxy test that took the incremental path is
    checked against a full render of the same call. Returns those renders."""
    return checked_renders(template, monkeypatch)


def checked_renders(template: ChatTemplate, monkeypatch: pytest.MonkeyPatch) -> list[Prompt]:
    """Makes each render of `template` that takes the incremental path check
    itself against a full render of the same call: same ids, same reused
    turns at the same places. Returns those renders, as they are made."""
    checked: list[Prompt] = []
    render = template.render

    def checking_render(request: Any, matched: Any, enable_thinking: bool, memo: Any = None) -> Prompt:
        prompt = render(request, matched, enable_thinking, memo)
        if prompt.incremental:
            full = render(request, matched, enable_thinking)
            assert not full.incremental and (prompt.ids, prompt.gen_tail) == (full.ids, full.gen_tail)
            assert prompt.reused_spans == full.reused_spans
            checked.append(prompt)
        return prompt

    monkeypatch.setattr(template, "render", checking_render)
    return checked


@pytest.fixture(scope="session")
def _engine_server(tokenizer: Any) -> Iterator[tuple[ScriptedEngine, str]]:
    engine = ScriptedEngine(tokenizer)
    with ServerThread(engine.app) as server:
        yield engine, server.url


@pytest.fixture()
def engine(_engine_server: tuple[ScriptedEngine, str]) -> ScriptedEngine:
    engine, _ = _engine_server
    engine.reset()
    return engine


@dataclass
class Proxy:
    url: str
    core: ProxyCore

    def new_session(self, **spec: Any) -> dict[str, Any]:
        """Creates a session through the admin API: {"key", "urls"}."""
        reply = httpx.post(f"{self.url}/admin/sessions", json=spec, headers={"authorization": f"Bearer {ADMIN_TOKEN}"})
        assert reply.status_code == 201, reply.text
        return reply.json()

    def trajectory(self, key: str) -> dict[str, Any]:
        reply = httpx.get(
            f"{self.url}/admin/sessions/{key}/trajectory", headers={"authorization": f"Bearer {ADMIN_TOKEN}"}
        )
        assert reply.status_code == 200, reply.text
        return reply.json()


@pytest.fixture(scope="session")
def _proxy_server(_engine_server: tuple[ScriptedEngine, str], template: ChatTemplate) -> Iterator[Proxy]:
    _, engine_url = _engine_server
    core = ProxyCore(template, ProxyEngineClient(engine_url, "scripted"), SessionStore(), max_context=MAX_CONTEXT)
    with ServerThread(build_app(core, keepalive_s=0.2, admin_token=ADMIN_TOKEN)) as server:
        yield Proxy(server.url, core)


@pytest.fixture()
def proxy(_proxy_server: Proxy, engine: ScriptedEngine) -> Proxy:
    return _proxy_server
