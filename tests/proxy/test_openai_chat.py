"""The official `openai` SDK against the proxy (chat completions): tool calls
the SDK parses are the engine's, captured ids and logprobs are the engine's,
and a tool loop merges into one sequence."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest

from .chat_formats import BASH
from .scripted_engine import ScriptedEngine


def call_text(name: str, args: dict[str, Any], thought: str = "I should look.", prose: str = "") -> str:
    return (
        f"<think>\n{thought}\n</think>\n\n{prose}"
        f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>"
    )


def assert_captured(seq: dict[str, Any], engine: ScriptedEngine) -> None:
    """Every masked-in token is one the engine sampled, in order, with its logprob."""
    sampled = [
        (t, lp) for t, m, lp in zip(seq["token_ids"], seq["loss_mask"], seq["behavior_logprobs"], strict=True) if m
    ]
    emitted = [
        (t, lp) for reply in engine.log.replies for t, lp in zip(reply["token_ids"], reply["logprobs"], strict=True)
    ]
    assert sampled == emitted


@pytest.mark.parametrize("stream", [False, True])
def test_tool_loop_merges_into_one_sequence(proxy: Any, engine: ScriptedEngine, stream: bool) -> None:
    session = proxy.new_session()
    client = openai.OpenAI(base_url=session["urls"]["openai"], api_key=session["key"])
    engine.push(call_text("bash", {"command": "ls -la"}), "All done: two files.")

    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "List the files."},
    ]
    if stream:
        chunks = list(
            client.chat.completions.create(
                model="m", messages=messages, tools=[BASH], stream=True, stream_options={"include_usage": True}
            )
        )
        calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
        call_id, name, args = calls[0].id, calls[0].function.name, calls[0].function.arguments
        assert chunks[-2].choices[0].finish_reason == "tool_calls"
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(
            engine.log.replies[0]["token_ids"]
        )
    else:
        reply = client.chat.completions.create(model="m", messages=messages, tools=[BASH])
        call = reply.choices[0].message.tool_calls[0]
        call_id, name, args = call.id, call.function.name, call.function.arguments
        assert reply.choices[0].finish_reason == "tool_calls"
    assert name == "bash" and json.loads(args) == {"command": "ls -la"}

    # The harness re-serialises the arguments compactly, as OpenCode does.
    messages += [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": call_id, "type": "function", "function": {"name": "bash", "arguments": '{"command":"ls -la"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": call_id, "content": "a.txt\nb.txt"},
    ]
    final = client.chat.completions.create(model="m", messages=messages, tools=[BASH])
    assert final.choices[0].message.content == "All done: two files."

    traj = proxy.trajectory(session["key"])
    assert [c["merged"] for c in traj["calls"]] == [False, True]
    assert len(traj["sequences"]) == 1
    seq = traj["sequences"][0]
    assert_captured(seq, engine)
    # Each prompt the engine saw extends the previous prompt + completion exactly.
    first_prompt, second_prompt = engine.log.prompts
    assert second_prompt[: len(first_prompt) + len(engine.log.replies[0]["token_ids"])] == (
        first_prompt + engine.log.replies[0]["token_ids"]
    )
    assert seq["token_ids"] == second_prompt + engine.log.replies[1]["token_ids"]
