"""The official `openai` SDK's Responses API against the proxy, used as Codex
uses it: stateless, developer messages, reasoning items coming back with
their `encrypted_content`, function and freeform tools."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest

from .scripted_engine import ScriptedEngine
from .test_openai_chat import assert_captured, call_text

TOOLS = [
    {"type": "function", "name": "shell", "description": "Run a command.", "strict": False,
     "parameters": {"type": "object", "properties": {"cmd": {"type": "array", "items": {"type": "string"}}}}},
    {"type": "custom", "name": "apply_patch", "description": "Apply a patch.",
     "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"}},
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
    engine.push(call_text("shell", {"cmd": ["ls"]}, thought="look around"),
                call_text("apply_patch", {"input": "*** Begin Patch\n*** End Patch"}, thought="patch it"),
                "Patched.")
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
