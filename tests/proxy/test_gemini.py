"""Gemini's wire format (as Gemini CLI sends it) against the proxy: function
calls and responses, thought parts the CLI drops on the way back, SSE."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from .scripted_engine import ScriptedEngine
from .test_openai_chat import assert_captured, call_text

TOOLS = [
    {
        "functionDeclarations": [
            {
                "name": "run_shell_command",
                "description": "Run a command.",
                "parameters": {
                    "type": "OBJECT",
                    "properties": {"command": {"type": "STRING"}},
                    "required": ["command"],
                },
            }
        ]
    }
]


def generate(base: str, key: str, contents: list[dict[str, Any]], stream: bool) -> dict[str, Any]:
    action = "streamGenerateContent?alt=sse" if stream else "generateContent"
    body = {
        "contents": contents,
        "tools": TOOLS,
        "systemInstruction": {"parts": [{"text": "You are Gemini CLI."}]},
        "generationConfig": {"temperature": 0, "thinkingConfig": {"includeThoughts": True}},
    }
    reply = httpx.post(f"{base}/v1beta/models/policy:{action}", json=body, headers={"x-goog-api-key": key}, timeout=30)
    assert reply.status_code == 200, reply.text
    if not stream:
        return reply.json()
    events = [json.loads(line[6:]) for line in reply.text.splitlines() if line.startswith("data: ")]
    assert len(events) == 1 and "[DONE]" not in reply.text
    return events[0]


@pytest.mark.parametrize("stream", [False, True])
def test_gemini_cli_style_loop(proxy: Any, engine: ScriptedEngine, template: Any, stream: bool) -> None:
    session = proxy.new_session()
    engine.push(call_text("run_shell_command", {"command": "ls"}, thought="list"), "Two files.")
    contents: list[dict[str, Any]] = [{"role": "user", "parts": [{"text": "What files?"}]}]
    first = generate(session["urls"]["gemini"], session["key"], contents, stream)
    thought, call = first["candidates"][0]["content"]["parts"]
    assert thought == {"text": "list", "thought": True}
    assert call["functionCall"]["name"] == "run_shell_command" and call["functionCall"]["args"] == {"command": "ls"}
    # The CLI drops thought parts and call ids when it sends the turn back.
    contents += [
        {"role": "model", "parts": [{"functionCall": {"name": "run_shell_command", "args": {"command": "ls"}}}]},
        {
            "role": "user",
            "parts": [{"functionResponse": {"name": "run_shell_command", "response": {"output": "a\nb"}}}],
        },
    ]
    final = generate(session["urls"]["gemini"], session["key"], contents, stream)
    assert final["candidates"][0]["content"]["parts"] == [{"text": "Two files."}]
    assert final["candidates"][0]["finishReason"] == "STOP"
    # Upper-case OpenAPI types reach the template as JSON Schema.
    assert '"type": "string"' in template.decode(engine.log.prompts[0])
    assert "<tool_response>\na\nb\n</tool_response>" in template.decode(engine.log.prompts[1])
    traj = proxy.trajectory(session["key"])
    assert [c["merged"] for c in traj["calls"]] == [False, True]
    assert_captured(traj["sequences"][0], engine)


def test_gemini_count_tokens_and_errors(proxy: Any, engine: ScriptedEngine) -> None:
    session = proxy.new_session()
    base = session["urls"]["gemini"]
    body = {"contents": [{"role": "user", "parts": [{"text": "hi"}]}]}
    counted = httpx.post(f"{base}/v1beta/models/policy:countTokens", json=body).json()
    httpx.post(f"{base}/v1beta/models/policy:generateContent", json=body)
    assert counted["totalTokens"] == len(engine.log.prompts[0])
    unknown = httpx.post(f"{proxy.url}/v1beta/models/policy:generateContent", json=body, params={"key": "nope"})
    assert unknown.status_code == 401 and unknown.json()["error"]["status"] == "UNAUTHENTICATED"
    image = {"contents": [{"role": "user", "parts": [{"inlineData": {"mimeType": "image/png", "data": ""}}]}]}
    rejected = httpx.post(f"{base}/v1beta/models/policy:generateContent", json=image)
    assert rejected.status_code == 400 and "text only" in rejected.json()["error"]["message"]
    missing = httpx.post(f"{base}/v1beta/models/policy:embedContent", json=body)
    assert missing.status_code == 404 and missing.json()["error"]["status"] == "NOT_FOUND"
