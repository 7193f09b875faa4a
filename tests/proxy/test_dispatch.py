"""The model-call fast path resolves exactly what Starlette's declared routes
resolve, really skips Starlette, and leaves every other request to it; the
hot path's JSON codec falls back to the standard library wherever orjson
refuses or differs."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from starlette.routing import Match, Mount
from starlette.testclient import TestClient

from rollout_server.proxy import jsonio
from rollout_server.proxy.app import ProxyApp, build_app
from rollout_server.proxy.engine_client import ProxyEngineClient
from rollout_server.proxy.render import ChatTemplate
from rollout_server.proxy.service import ProxyCore
from rollout_server.proxy.session import SessionStore

HI = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
PATHS = [
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/v1/chat/completions",
    "/v1/responses",
    "/v1beta/models/policy:generateContent",
    "/v1/models/policy:streamGenerateContent",
    # Not model calls, or not routes at all: the fast path must pass them on.
    "/",
    "/health",
    "/v1/models",
    "/v1/chat/completions/",
    "/v1/chat",
    "/v1beta/models/",
    "/v1beta/models/a/b",
    "/admin/sessions",
    "/v2/messages",
]


@pytest.fixture()
def app(template: ChatTemplate) -> ProxyApp:
    # An engine nobody listens on: these requests never get past the session check.
    core = ProxyCore(template, ProxyEngineClient("http://127.0.0.1:9", "m"), SessionStore(), max_context=512)
    return build_app(core, admin_token="t")


def _starlette_resolves(routes: list[Any], scope: dict[str, Any]) -> tuple[Any, dict[str, str]] | None:
    """The endpoint and path parameters Starlette's router picks for a POST, walking mounts."""
    for route in routes:
        match, child = route.matches(scope)
        if match is Match.FULL:
            scope = {**scope, **child}
            if isinstance(route, Mount):
                return _starlette_resolves(route.routes, scope)
            return route.endpoint, scope["path_params"]
    return None


@pytest.mark.parametrize("path", [*PATHS, *(f"/s/k-1{p}" for p in PATHS), "/s//v1/messages", "/s/k", "/s/k/"])
def test_fast_path_resolves_what_starlette_resolves(app: ProxyApp, path: str) -> None:
    scope = {"type": "http", "method": "POST", "path": path, "root_path": "", "path_params": {}}
    expected = _starlette_resolves(app.starlette.routes, scope)
    if expected is not None and expected[0] not in (*app.posts.values(), app.gemini_call):
        expected = None  # probes, admin, health: Starlette's own
    assert app.match_post(path) == expected


def test_model_calls_skip_starlette_and_the_rest_go_through_it(app: ProxyApp, monkeypatch: pytest.MonkeyPatch) -> None:
    with TestClient(app) as client:
        # Starlette answers other methods on a model route as declared.
        assert client.get("/v1/chat/completions").status_code == 405
        assert client.get("/health").json() == {"ok": True, "sessions": 0}

        async def refuse(*_: Any) -> None:
            raise AssertionError("a model call went through Starlette")

        monkeypatch.setattr(app, "starlette", refuse)
        for path in ("/v1/chat/completions", "/s/k/v1/messages", "/v1beta/models/p:generateContent"):
            assert client.post(path, json=HI).status_code == 401, path
        with pytest.raises(AssertionError, match="through Starlette"):
            client.get("/health")


def test_requests_under_a_root_path_take_the_declared_routes(app: ProxyApp) -> None:
    with TestClient(app, root_path="/v1") as client:
        # Starlette routes "/messages" here (no such route), though the full path reads as Anthropic's.
        assert client.post("/v1/messages", json=HI).status_code == 404
        reply = client.post("/v1/s/k/v1/chat/completions", json=HI)
        assert reply.status_code == 401 and reply.json()["error"]["code"] == "invalid_api_key"


def test_json_codec_falls_back_where_orjson_refuses() -> None:
    # An engine's -Infinity logprob parses (the proxy's finiteness check answers it), as `json` reads it.
    assert math.isinf(jsonio.loads(b'{"logprobs": [-Infinity]}')["logprobs"][0])
    with pytest.raises(json.JSONDecodeError):
        jsonio.loads(b'{"truncated": ')
    with pytest.raises(UnicodeDecodeError):
        jsonio.loads(b'"\xff"')
    for value in ({1: "int key"}, {"big": 2**70}, {"text": "naïve ✓", "ids": [1, 2], "x": -0.25, "none": None}):
        assert json.loads(jsonio.dumps(value)) == json.loads(json.dumps(value))
    assert jsonio.dumps({"text": "naïve"}) == '{"text":"naïve"}'.encode()
    assert json.loads(jsonio.dumps({"half": "\ud800"})) == {"half": "\ud800"}  # no UTF-8 form: escaped


_json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)


@given(value=_json_values)
@settings(max_examples=300, deadline=None)
def test_json_parse_is_exactly_the_standard_librarys(value: Any) -> None:
    """Harness bodies go through `jsonio.loads`: integers of any size stay
    integers (orjson alone reads those past 64 bits as floats)."""
    raw = json.dumps(value).encode()
    parsed = jsonio.loads(raw)
    assert parsed == json.loads(raw)
    assert json.dumps(parsed) == json.dumps(json.loads(raw))  # same types too: 1 and 1.0 compare equal


def test_integers_at_the_64_bit_edges_stay_integers() -> None:
    for n in (2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**63), -(2**63) - 1, 10**30, -(10**30)):
        parsed = jsonio.loads(json.dumps({"arguments": {"id": n}, "list": [n]}).encode())
        assert parsed == {"arguments": {"id": n}, "list": [n]} and type(parsed["list"][0]) is int
