"""The official `openai` SDK's Responses API against the proxy, used as Codex
uses it: stateless, developer messages, reasoning items coming back with
their `encrypted_content`, function and freeform tools."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest

from .scripted_engine import ScriptedEngine
from .test_openai_chat import assert_captured, call_text

TOOLS = [
    {
        "type": "function",
        "name": "shell",
        "description": "Run a command.",
        "strict": False,
        "parameters": {"type": "object", "properties": {"cmd": {"type": "array", "items": {"type": "string"}}}},
    },
    {
        "type": "custom",
        "name": "apply_patch",
        "description": "Apply a patch.",
        "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"},
    },
    {"type": "web_search"},
]


def create(client: openai.OpenAI, items: list[dict[str, Any]], stream: bool) -> Any:
    kwargs = dict(model="policy", input=items, tools=TOOLS, store=False, include=["reasoning.encrypted_content"])
    if not stream:
        return client.responses.create(**kwargs)
    with client.responses.stream(**kwargs) as events:
        return events.get_final_response()


@pytest.mark.parametrize("stream", [False, True])
def test_codex_style_loop(proxy: Any, engine: ScriptedEngine, stream: bool) -> None:
    session = proxy.new_session()
    client = openai.OpenAI(base_url=session["urls"]["openai"], api_key=session["key"], max_retries=0)
    engine.push(
        call_text("shell", {"cmd": ["ls"]}, thought="look around"),
        call_text("apply_patch", {"input": "*** Begin Patch\n*** End Patch"}, thought="patch it"),
        "Patched.",
    )
    items: list[dict[str, Any]] = [
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "You are Codex."}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Fix it."}]},
    ]
    for expected in ("function_call", "custom_tool_call"):
        reply = create(client, items, stream)
        reasoning, call = reply.output
        assert reasoning.type == "reasoning" and call.type == expected
        if expected == "function_call":
            assert json.loads(call.arguments) == {"cmd": ["ls"]}
            output = {"type": "function_call_output", "call_id": call.call_id, "output": "a.py"}
        else:
            assert call.input == "*** Begin Patch\n*** End Patch"
            output = {"type": "custom_tool_call_output", "call_id": call.call_id, "output": "ok"}
        items += [reasoning.model_dump(exclude_none=True), call.model_dump(exclude_none=True), output]
    final = create(client, items, stream)
    assert final.output_text == "Patched." and final.status == "completed"

    traj = proxy.trajectory(session["key"])
    assert [c["merged"] for c in traj["calls"]] == [False, True, True]
    assert [c["reused_turns"] for c in traj["calls"]] == [0, 1, 2]
    assert_captured(traj["sequences"][0], engine)


def test_string_input_instructions_and_errors(proxy: Any, engine: ScriptedEngine, template: Any) -> None:
    session = proxy.new_session()
    client = openai.OpenAI(base_url=session["urls"]["openai"], api_key=session["key"], max_retries=0)
    reply = client.responses.create(model="policy", instructions="Be brief.", input="hello")
    assert reply.output_text == "ok"
    assert template.decode(engine.log.prompts[0]).startswith("<|im_start|>system\nBe brief.<|im_end|>")
    with pytest.raises(openai.BadRequestError) as bad:
        client.responses.create(model="policy", input=[{"type": "mystery_item"}])  # type: ignore[list-item]
    assert "mystery_item" in bad.value.body["message"]


# As Codex 0.17x sent them (trimmed): a `namespace` tool grouping sub-agent functions
# beside plain ones, and a namespaced call coming back with its `namespace`.
CODEX_TOOLS = [
    {
        "type": "function",
        "name": "exec_command",
        "description": "Runs a command in a PTY.",
        "strict": False,
        "parameters": {
            "type": "object",
            "properties": {"cmd": {"type": "string"}},
            "required": ["cmd"],
            "additionalProperties": False,
        },
    },
    {
        "type": "namespace",
        "name": "multi_agent_v1",
        "description": "Tools for spawning and managing sub-agents.",
        "tools": [
            {
                "type": "function",
                "name": "close_agent",
                "description": "Close an agent.",
                "strict": False,
                "parameters": {
                    "type": "object",
                    "properties": {"target": {"type": "string"}},
                    "required": ["target"],
                    "additionalProperties": False,
                },
            },
            {
                "type": "function",
                "name": "exec_command",
                "description": "Run in an agent.",
                "strict": False,
                "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}},
            },
        ],
    },
    {"type": "web_search", "external_web_access": True},
]


def test_namespace_tools_as_codex_sends_them(proxy: Any, engine: ScriptedEngine, template: Any) -> None:
    session = proxy.new_session()
    engine.push(
        call_text("close_agent", {"target": "a1"}), call_text("multi_agent_v1.exec_command", {"cmd": "ls"}), "Done."
    )
    items: list[dict[str, Any]] = [
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "You are Codex."}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Tidy up."}]},
    ]
    for expected, args in (
        (("multi_agent_v1", "close_agent"), {"target": "a1"}),
        (("multi_agent_v1", "exec_command"), {"cmd": "ls"}),
    ):
        reply = httpx.post(
            f"{session['urls']['openai']}/responses",
            headers={"authorization": f"Bearer {session['key']}"},
            json={"model": "policy", "input": items, "tools": CODEX_TOOLS, "store": False},
            timeout=30,
        )
        assert reply.status_code == 200, reply.text
        reasoning, call = reply.json()["output"]
        # Codex dispatches a namespaced tool only when the call names its namespace.
        assert (call["namespace"], call["name"]) == expected and json.loads(call["arguments"]) == args
        items += [
            reasoning,
            {
                "type": "function_call",
                "status": "completed",
                "id": call["id"],
                "name": call["name"],
                "namespace": call["namespace"],
                "arguments": call["arguments"],
                "call_id": call["call_id"],
            },
            {"type": "function_call_output", "call_id": call["call_id"], "output": "ok"},
        ]
    prompt = template.decode(engine.log.prompts[0])
    # Unique inner names stay bare; the inner exec_command would clash with the top-level one.
    assert '"name": "close_agent"' in prompt and '"name": "multi_agent_v1.exec_command"' in prompt
    assert '"name": "exec_command"' in prompt and "web_search" not in prompt
    reply = httpx.post(
        f"{session['urls']['openai']}/responses",
        headers={"authorization": f"Bearer {session['key']}"},
        json={"model": "policy", "input": items, "tools": CODEX_TOOLS, "store": False},
        timeout=30,
    )
    assert reply.json()["output"][0]["content"][0]["text"] == "Done."
    traj = proxy.trajectory(session["key"])
    assert [c["merged"] for c in traj["calls"]] == [False, True, True] and [
        c["reused_turns"] for c in traj["calls"]
    ] == [0, 1, 2]
    assert_captured(traj["sequences"][0], engine)
    bad = httpx.post(
        f"{session['urls']['openai']}/responses",
        headers={"authorization": f"Bearer {session['key']}"},
        json={
            "model": "policy",
            "input": "x",
            "tools": [{"type": "namespace", "name": "n", "tools": [{"type": "namespace", "name": "m", "tools": []}]}],
        },
    )
    assert bad.status_code == 400 and "tools[0].tools[0].type" in bad.json()["error"]["message"]
