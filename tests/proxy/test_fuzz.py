"""Property-based fuzzing of every route: whatever arrives, no 5xx (the
engine is up), an answer in the route's dialect, and nothing from one
session reaches another."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient

from legorl_jax.core.config import SessionCaps
from rollout_server.proxy.app import build_app
from rollout_server.proxy.engine_client import ProxyEngineClient
from rollout_server.proxy.service import ProxyCore
from rollout_server.proxy.session import SessionSpec, SessionStore

from .scripted_engine import ScriptedEngine

SECRET = "zebra-secret-of-session-b"

scalars = (
    st.none()
    | st.booleans()
    | st.integers(-3, 3)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12)
)
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=12,
)


def mostly(valid: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Usually a well-formed value, sometimes any JSON, so the fuzz gets past
    the first check and into the deeper ones."""
    return st.one_of(valid, valid, valid, json_values)


roles = mostly(st.sampled_from(["user", "assistant", "system", "tool", "developer", "model", "function"]))
short = st.text(max_size=12)
text_part = st.fixed_dictionaries(
    {
        "type": mostly(
            st.sampled_from(["text", "input_text", "output_text", "image", "tool_use", "tool_result", "thinking"])
        ),
        "text": mostly(short),
    },
    optional={
        "id": mostly(short),
        "tool_use_id": mostly(short),
        "input": json_values,
        "name": mostly(short),
        "content": mostly(short),
        "thinking": mostly(short),
        "cache_control": json_values,
    },
)
content = mostly(short | st.none() | st.lists(text_part, max_size=3))
tool_call = st.fixed_dictionaries(
    {
        "id": mostly(short),
        "type": st.just("function"),
        "function": st.fixed_dictionaries({"name": mostly(short), "arguments": mostly(st.text(max_size=20))}),
    }
)
message = st.fixed_dictionaries(
    {"role": roles, "content": content},
    optional={"tool_calls": mostly(st.lists(tool_call, max_size=2)), "tool_call_id": mostly(short)},
)
messages = mostly(st.lists(message, min_size=1, max_size=4))
schema = mostly(st.just({"type": "object", "properties": {"a": {"type": "string"}}}))
function_tool = st.fixed_dictionaries(
    {
        "type": mostly(st.sampled_from(["function", "custom", "namespace"])),
        "name": mostly(short),
        "function": st.fixed_dictionaries({"name": short, "parameters": schema}),
        "input_schema": schema,
        "parameters": schema,
    }
)
common = {
    "model": mostly(short),
    "stream": mostly(st.booleans()),
    "max_tokens": mostly(st.integers(-2, 40)),
    "tools": mostly(st.lists(function_tool, max_size=2)),
}
item = st.fixed_dictionaries(
    {
        "type": mostly(
            st.sampled_from(["message", "function_call", "function_call_output", "reasoning", "custom_tool_call"])
        )
    },
    optional={
        "role": roles,
        "content": content,
        "call_id": mostly(short),
        "name": mostly(short),
        "arguments": mostly(st.text(max_size=10)),
        "output": content,
        "encrypted_content": mostly(short),
        "summary": json_values,
        "input": mostly(short),
    },
)
part = st.fixed_dictionaries(
    {},
    optional={
        "text": mostly(short),
        "thought": st.booleans(),
        "functionCall": mostly(st.fixed_dictionaries({"name": short, "args": mostly(st.just({"a": 1}))})),
        "functionResponse": mostly(st.fixed_dictionaries({"name": short, "response": json_values})),
    },
)

BODIES = {
    "/v1/chat/completions": st.fixed_dictionaries({"messages": messages}, optional=common),
    "/v1/messages": st.fixed_dictionaries(
        {"messages": messages}, optional={**common, "system": content, "thinking": json_values}
    ),
    "/v1/messages/count_tokens": st.fixed_dictionaries({"messages": messages}, optional=common),
    "/v1/responses": st.fixed_dictionaries(
        {"input": mostly(short | st.lists(item, min_size=1, max_size=4))},
        optional={**common, "instructions": mostly(short)},
    ),
    "/v1beta/models/m:generateContent": st.fixed_dictionaries(
        {
            "contents": mostly(
                st.lists(
                    st.fixed_dictionaries({"role": roles, "parts": mostly(st.lists(part, max_size=3))}),
                    min_size=1,
                    max_size=3,
                )
            )
        },
        optional={
            "generationConfig": mostly(
                st.fixed_dictionaries({}, optional={"maxOutputTokens": mostly(st.integers(-1, 20))})
            ),
            "systemInstruction": mostly(st.fixed_dictionaries({"parts": st.lists(part, max_size=2)})),
            "tools": json_values,
        },
    ),
}


@pytest.fixture(scope="module")
def fuzz_target(
    _engine_server: tuple[ScriptedEngine, str], template: Any
) -> Iterator[tuple[TestClient, SessionStore, ScriptedEngine]]:
    engine, url = _engine_server
    engine.reset()
    store = SessionStore(SessionCaps(max_model_calls=100000, max_total_tokens=10**9, max_wall_s=3600))
    core = ProxyCore(template, ProxyEngineClient(url, "scripted"), store, max_context=2048)
    with TestClient(build_app(core, keepalive_s=5.0, admin_token="t"), raise_server_exceptions=True) as client:
        yield client, store, engine


def _check(reply: Any) -> None:
    assert reply.status_code < 500, reply.text
    if reply.headers.get("content-type", "").startswith("application/json"):
        json.loads(reply.text)


@settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_fuzz_dialect_routes(fuzz_target: tuple[TestClient, SessionStore, ScriptedEngine], data: st.DataObject) -> None:
    client, store, engine = fuzz_target
    victim = store.create(SessionSpec())
    victim_reply = client.post(
        f"/s/{victim.key}/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": SECRET}]}
    )
    assert victim_reply.status_code == 200
    attacker = store.create(SessionSpec())
    seen = len(engine.log.prompts)
    for path, bodies in BODIES.items():
        body = data.draw(bodies, label=path)
        _check(client.post(f"/s/{attacker.key}{path}", json=body))
        # The same body at the root, routed by header, and without any key.
        _check(client.post(path, json=body, headers={"x-api-key": attacker.key}))
        denied = client.post(path, json=body)
        assert denied.status_code == 401
    # No prompt built for the attacker carries the victim's conversation, and
    # the victim's trajectory is untouched.
    for prompt in engine.log.prompts[seen:]:
        assert SECRET not in engine.tokenizer.decode(prompt)
    assert len(victim.trajectory.calls) == 1


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    path=st.text(alphabet=st.sampled_from("/abcsv1:-_?=.%"), max_size=30),
    raw=st.binary(max_size=60),
    method=st.sampled_from(["GET", "POST", "PUT", "DELETE", "HEAD", "PATCH"]),
)
def test_fuzz_any_path_and_bytes(
    fuzz_target: tuple[TestClient, SessionStore, ScriptedEngine], path: str, raw: bytes, method: str
) -> None:
    client, store, _ = fuzz_target
    key = store.create(SessionSpec()).key
    for prefix in ("", f"/s/{key}"):
        reply = client.request(
            method,
            prefix + "/" + path.lstrip("/"),
            content=raw,
            headers={"authorization": f"Bearer {key}", "content-type": "application/json"},
        )
        assert reply.status_code < 500, (method, path, reply.text)
