"""Routing, sessions, admin API, caps, engine failures, keep-alives and
stream aborts, over real HTTP."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import openai
import pytest

from legorl_jax.core.seeds import derive_seed

from .conftest import ADMIN_TOKEN
from .scripted_engine import ScriptedEngine

ADMIN = {"authorization": f"Bearer {ADMIN_TOKEN}"}
HI = [{"role": "user", "content": "hi"}]


def test_admin_api(proxy: Any, engine: ScriptedEngine) -> None:
    assert httpx.post(f"{proxy.url}/admin/sessions", json={}).status_code == 401
    assert httpx.post(f"{proxy.url}/admin/sessions", json={}, headers={"authorization": "Bearer no"}).status_code == 401
    bad = httpx.post(f"{proxy.url}/admin/sessions", json={"sampling": {"temperature": -1}}, headers=ADMIN)
    assert bad.status_code == 400 and "temperature" in bad.json()["error"]["message"]
    assert httpx.post(f"{proxy.url}/admin/sessions", content=b"{", headers=ADMIN).status_code == 400
    assert httpx.post(f"{proxy.url}/admin/sessions", json={"key": "a/b"}, headers=ADMIN).status_code == 400
    made = proxy.new_session(key="fixed-key", labels={"task": "t1"})
    assert made["urls"] == {
        "anthropic": f"{proxy.url}/s/fixed-key",
        "openai": f"{proxy.url}/s/fixed-key/v1",
        "gemini": f"{proxy.url}/s/fixed-key",
    }
    assert httpx.post(f"{proxy.url}/admin/sessions", json={"key": "fixed-key"}, headers=ADMIN).status_code == 409
    assert proxy.trajectory("fixed-key")["labels"] == {"task": "t1"}
    gone = httpx.delete(f"{proxy.url}/admin/sessions/fixed-key", headers=ADMIN)
    assert gone.status_code == 200 and gone.json()["key"] == "fixed-key"
    assert httpx.delete(f"{proxy.url}/admin/sessions/fixed-key", headers=ADMIN).status_code == 404
    assert httpx.get(f"{proxy.url}/admin/sessions/fixed-key/trajectory", headers=ADMIN).status_code == 404
    # A deleted session's key no longer reaches the engine.
    reply = httpx.post(f"{proxy.url}/s/fixed-key/v1/chat/completions", json={"model": "m", "messages": HI})
    assert reply.status_code == 401 and reply.json()["error"]["code"] == "invalid_api_key"
    assert engine.log.prompts == []


def test_admin_api_refuses_sessions_past_the_bound(proxy: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Sessions live until deleted (a trajectory is never dropped unread), so the
    bound on live sessions is what keeps an owner that never deletes from
    growing the proxy without limit: past it, 429 naming the way out."""
    monkeypatch.setattr(proxy.core.store, "max_sessions", len(proxy.core.store) + 1)
    proxy.new_session(key="bounded-1")
    full = httpx.post(f"{proxy.url}/admin/sessions", json={"key": "bounded-2"}, headers=ADMIN)
    assert full.status_code == 429 and "proxy.max_sessions" in full.json()["error"]["message"]
    assert httpx.delete(f"{proxy.url}/admin/sessions/bounded-1", headers=ADMIN).status_code == 200
    assert proxy.new_session(key="bounded-2")["key"] == "bounded-2"
    assert httpx.delete(f"{proxy.url}/admin/sessions/bounded-2", headers=ADMIN).status_code == 200


@pytest.mark.parametrize(
    "path, shape",
    [
        ("/v1/chat/completions", lambda b: b["error"]["code"]),
        ("/v1/responses", lambda b: b["error"]["code"]),
        ("/v1/messages", lambda b: b["error"]["type"]),
        ("/v1beta/models/m:generateContent", lambda b: b["error"]["status"]),
    ],
)
def test_unknown_key_and_bad_json_in_each_dialect(proxy: Any, engine: ScriptedEngine, path: str, shape: Any) -> None:
    denied = httpx.post(f"{proxy.url}{path}", content=b"{}", headers={"x-api-key": "nobody"})
    assert denied.status_code == 401 and shape(denied.json()) in (
        "invalid_api_key",
        "authentication_error",
        "UNAUTHENTICATED",
    )
    key = proxy.new_session()["key"]
    broken = httpx.post(
        f"{proxy.url}/s/{key}{path}", content=b'{"messages": [', headers={"content-type": "application/json"}
    )
    assert broken.status_code == 400 and "not valid JSON" in str(broken.json())
    wrong = httpx.post(f"{proxy.url}/s/{key}{path}", json=[1, 2])
    assert wrong.status_code == 400 and "request body: expected dict" in str(wrong.json())


def test_trainer_sampling_overrides_the_harness(proxy: Any, engine: ScriptedEngine) -> None:
    session = proxy.new_session(sampling={"temperature": 0.6, "top_p": 1.0, "top_k": -1, "max_tokens": 50})
    client = openai.OpenAI(base_url=session["urls"]["openai"], api_key=session["key"], max_retries=0)
    client.chat.completions.create(model="m", messages=HI, temperature=0.0, top_p=0.1, max_tokens=4000)  # type: ignore[arg-type]
    client.chat.completions.create(model="m", messages=HI, max_tokens=7)  # type: ignore[arg-type]
    first, second = engine.log.bodies
    assert (first["temperature"], first["top_p"], first["top_k"], first["max_tokens"]) == (0.6, 1.0, -1, 50)
    assert second["max_tokens"] == 7
    assert first["stop_token_ids"] == [proxy.core.template.turn_end_id]
    assert proxy.trajectory(session["key"])["calls"][0]["sampling"]["temperature"] == 0.6


def test_a_seeded_session_seeds_every_call_and_an_unseeded_one_none(proxy: Any, engine: ScriptedEngine) -> None:
    """A trial's seed makes its episode reproducible: call k samples with a seed derived from the
    session's and k, the same for the same session seed, distinct across calls and sessions."""
    seeds = []
    for seed in (41, 41, 42, None):
        session = proxy.new_session(**({} if seed is None else {"seed": seed}))
        client = openai.OpenAI(base_url=session["urls"]["openai"], api_key=session["key"], max_retries=0)
        for _ in range(2):
            client.chat.completions.create(model="m", messages=HI)  # type: ignore[arg-type]
        seeds.append([body.get("seed") for body in engine.log.bodies[-2:]])
    same, again, other, unseeded = seeds
    assert same == again == [derive_seed(41, 0), derive_seed(41, 1)]
    assert len({*same, *other}) == 4 and all(0 < s < 2**63 for s in same + other)
    assert unseeded == [None, None]  # no seed sent: the engine draws its own
    bad = httpx.post(f"{proxy.url}/admin/sessions", json={"seed": 0}, headers=ADMIN)
    assert bad.status_code == 400 and "seed" in bad.json()["error"]["message"]


def test_call_cap_answers_in_dialect_and_marks_trajectory(proxy: Any, engine: ScriptedEngine) -> None:
    session = proxy.new_session(caps={"max_model_calls": 2, "max_total_tokens": 10000, "max_wall_s": 60})
    client = openai.OpenAI(base_url=session["urls"]["openai"], api_key=session["key"], max_retries=0)
    for _ in range(2):
        client.chat.completions.create(model="m", messages=HI)  # type: ignore[arg-type]
    with pytest.raises(openai.BadRequestError) as capped:
        client.chat.completions.create(model="m", messages=HI)  # type: ignore[arg-type]
    assert capped.value.body["code"] == "session_cap_exceeded"
    assert proxy.trajectory(session["key"])["metrics"]["cap_hit"] == "max_model_calls (2)"
    assert len(engine.log.prompts) == 2


def test_token_cap(proxy: Any, engine: ScriptedEngine) -> None:
    session = proxy.new_session(caps={"max_model_calls": 10, "max_total_tokens": 5, "max_wall_s": 60})
    client = openai.OpenAI(base_url=session["urls"]["openai"], api_key=session["key"], max_retries=0)
    client.chat.completions.create(model="m", messages=HI)  # type: ignore[arg-type]
    with pytest.raises(openai.BadRequestError) as capped:
        client.chat.completions.create(model="m", messages=HI)  # type: ignore[arg-type]
    assert proxy.trajectory(session["key"])["metrics"]["cap_hit"].startswith("max_total_tokens")
    # The refusal names the setting and how to raise it.
    message = capped.value.body["message"]
    assert "max_total_tokens (5)" in message and "--set proxy.max_total_tokens=N" in message
    assert "admin API" in message


def test_engine_down_is_503_and_other_sessions_recover(proxy: Any, engine: ScriptedEngine) -> None:
    session = proxy.new_session()
    client = openai.OpenAI(base_url=session["urls"]["openai"], api_key=session["key"], max_retries=0)
    engine.down = True
    with pytest.raises(openai.InternalServerError) as down:
        client.chat.completions.create(model="m", messages=HI)  # type: ignore[arg-type]
    assert down.value.status_code == 503 and down.value.body["code"] == "engine_unavailable"
    engine.down = False
    assert client.chat.completions.create(model="m", messages=HI).choices[0].message.content == "ok"  # type: ignore[arg-type]


def test_slow_engine_gets_keepalives_then_events(proxy: Any, engine: ScriptedEngine) -> None:
    key = proxy.new_session()["key"]
    engine.delay_s = 0.7  # the proxy under test sends a keep-alive every 0.2 s
    with httpx.stream(
        "POST",
        f"{proxy.url}/s/{key}/v1/chat/completions",
        timeout=30,
        json={"model": "m", "messages": HI, "stream": True},
    ) as reply:
        lines = [line for line in reply.iter_lines() if line]
    assert lines[0] == ": keep-alive"
    assert lines[-1] == "data: [DONE]" and any('"content":"ok"' in line for line in lines)


def test_slow_engine_failure_becomes_an_in_stream_error(proxy: Any, engine: ScriptedEngine) -> None:
    key = proxy.new_session()["key"]
    engine.delay_s, engine.down = 0.5, True
    with httpx.stream(
        "POST",
        f"{proxy.url}/s/{key}/v1/messages",
        timeout=30,
        json={"model": "m", "max_tokens": 5, "messages": HI, "stream": True},
    ) as reply:
        text = "".join(reply.iter_text())
    assert reply.status_code == 200 and "event: error" in text and "overloaded_error" in text


def test_stream_abort_does_not_stop_capture(proxy: Any, engine: ScriptedEngine) -> None:
    key = proxy.new_session()["key"]
    engine.delay_s = 0.6  # the proxy under test sends a keep-alive every 0.2 s
    with httpx.stream(
        "POST",
        f"{proxy.url}/s/{key}/v1/chat/completions",
        timeout=30,
        json={"model": "m", "messages": HI, "stream": True},
    ) as reply:
        assert next(reply.iter_lines()) == ": keep-alive"  # then the harness hangs up
    deadline = time.monotonic() + 10
    while not proxy.trajectory(key)["calls"] and time.monotonic() < deadline:
        time.sleep(0.05)
    (hung_up,) = proxy.trajectory(key)["calls"]  # recorded with its real latency, not 0
    assert hung_up["latency_s"] >= hung_up["engine_latency_s"] >= 0.5
    assert hung_up["client_disconnected"] is True
    engine.delay_s = 0.0
    # The retry after the abort extends what was captured.
    client = openai.OpenAI(base_url=f"{proxy.url}/s/{key}/v1", api_key="unused", max_retries=0)
    client.chat.completions.create(
        model="m",
        messages=[
            *HI,
            {"role": "assistant", "content": "ok"},  # type: ignore[arg-type]
            {"role": "user", "content": "more"},
        ],
    )
    traj = proxy.trajectory(key)
    assert [c["merged"] for c in traj["calls"]] == [False, True]
    assert traj["calls"][1]["latency_s"] > 0 and traj["calls"][1]["client_disconnected"] is False


def test_models_and_health(proxy: Any, engine: ScriptedEngine) -> None:
    session = proxy.new_session()
    client = openai.OpenAI(base_url=session["urls"]["openai"], api_key=session["key"], max_retries=0)
    assert [m.id for m in client.models.list()] == ["scripted"]
    assert httpx.get(f"{proxy.url}/health").json()["ok"] is True
    assert httpx.get(f"{proxy.url}/v1/models").status_code == 401


def test_concurrent_calls_in_one_session_are_all_captured(proxy: Any, engine: ScriptedEngine) -> None:
    session = proxy.new_session()
    engine.delay_s = 0.2

    async def run() -> list[str]:
        client = openai.AsyncOpenAI(base_url=session["urls"]["openai"], api_key=session["key"], max_retries=0)
        replies = await asyncio.gather(
            *(
                client.chat.completions.create(  # type: ignore[call-overload]
                    model="m", messages=[{"role": "system", "content": f"sub-agent {i}"}, *HI]
                )
                for i in range(4)
            )
        )
        return [r.choices[0].message.content for r in replies]

    assert asyncio.run(run()) == ["ok"] * 4
    traj = proxy.trajectory(session["key"])
    assert len(traj["calls"]) == 4 and len(traj["sequences"]) == 4
    assert sorted(s["root_reason"] for s in traj["sequences"]) == ["first_call"] + ["side_call"] * 3


def test_ids_from_token_id_strings_and_malformed_engine_replies(proxy: Any, engine: ScriptedEngine) -> None:
    session = proxy.new_session()
    client = openai.OpenAI(base_url=session["urls"]["openai"], api_key=session["key"], max_retries=0)
    engine.token_id_strings = True  # an engine without return_token_ids
    engine.push("from strings")
    assert client.chat.completions.create(model="m", messages=HI).choices[0].message.content == "from strings"  # type: ignore[arg-type]
    seq = proxy.trajectory(session["key"])["sequences"][0]
    assert [t for t, m in zip(seq["token_ids"], seq["loss_mask"], strict=True) if m] == engine.log.replies[0][
        "token_ids"
    ]
    engine.drop_logprob = True
    with pytest.raises(openai.InternalServerError) as broken:
        client.chat.completions.create(model="m", messages=HI)  # type: ignore[arg-type]
    assert broken.value.status_code == 503 and "logprobs" in broken.value.body["message"]
