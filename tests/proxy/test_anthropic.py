"""The official `anthropic` SDK against the proxy, shaped like Claude Code's
traffic: system blocks + a system message inside `messages`, cache_control
markers that move to the newest message, thinking blocks sent back."""

from __future__ import annotations

from typing import Any

import anthropic
import httpx
import pytest

from .scripted_engine import ScriptedEngine
from .test_openai_chat import assert_captured, call_text

TOOLS = [
    {
        "name": "Bash",
        "description": "Run a command.",
        "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]},
    }
]
CACHE = {"type": "ephemeral"}


def client(session: dict[str, Any]) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=session["urls"]["anthropic"], api_key=session["key"], max_retries=0)


def ask(c: anthropic.Anthropic, messages: list[dict[str, Any]], stream: bool) -> Any:
    """One call as Claude Code makes it: its billing header's hashes change on every call."""
    n = len(messages)
    billing = f"x-anthropic-billing-header: cc_version=2.1.332.{n:03x}; cc_entrypoint=cli; cch={n * 7919:05x};"
    kwargs: dict[str, Any] = dict(
        # The SDK refuses big non-streaming budgets itself; Claude Code streams with 32000.
        model="policy",
        max_tokens=32000 if stream else 4096,
        messages=messages,
        tools=TOOLS,
        system=[
            {"type": "text", "text": billing},
            {"type": "text", "text": "You are a coding agent.", "cache_control": CACHE},
        ],
        thinking={"type": "enabled", "budget_tokens": 1024},
    )
    if not stream:
        return c.messages.create(**kwargs)
    with c.messages.stream(**kwargs) as events:
        return events.get_final_message()


@pytest.mark.parametrize("stream", [False, True])
def test_claude_code_style_tool_loop(proxy: Any, engine: ScriptedEngine, template: Any, stream: bool) -> None:
    session = proxy.new_session()
    c = client(session)
    engine.push(call_text("Bash", {"command": "cat a.txt"}, thought="read it", prose="Reading."), "It says hi.")
    messages: list[dict[str, Any]] = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "<system-reminder>ctx</system-reminder>"},
                {"type": "text", "text": "What is in a.txt?", "cache_control": CACHE},
            ],
        }
    ]
    first = ask(c, messages, stream)
    assert first.stop_reason == "tool_use"
    thinking, text, tool_use = first.content
    assert (thinking.type, thinking.thinking) == ("thinking", "read it")
    assert text.text == "Reading."
    assert (tool_use.name, tool_use.input) == ("Bash", {"command": "cat a.txt"})
    assert first.usage.input_tokens == len(engine.log.prompts[0])

    # Back it comes, as Claude Code sends it: the cache marker moved to the newest block.
    messages[0]["content"][1].pop("cache_control")
    messages += [
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "read it", "signature": thinking.signature},
                {"type": "text", "text": "Reading."},
                {"type": "tool_use", "id": tool_use.id, "name": "Bash", "input": {"command": "cat a.txt"}},
            ],
        },
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": tool_use.id,
                    "content": [{"type": "text", "text": "hi", "cache_control": CACHE}],
                }
            ],
        },
    ]
    final = ask(c, messages, stream)
    assert final.stop_reason == "end_turn" and final.content[-1].text == "It says hi."
    traj = proxy.trajectory(session["key"])
    # One sequence: the header that differs per call is not part of the prompt.
    assert [call["merged"] for call in traj["calls"]] == [False, True]
    assert_captured(traj["sequences"][0], engine)
    assert "billing" not in template.decode(engine.log.prompts[1])


def test_system_message_inside_messages_joins_the_system_prompt(
    proxy: Any, engine: ScriptedEngine, template: Any
) -> None:
    session = proxy.new_session()
    c = client(session)
    reply = c.messages.create(
        model="policy",
        max_tokens=100,
        system="Top system.",
        messages=[{"role": "system", "content": "Inner system."}, {"role": "user", "content": "hi"}],
    )  # type: ignore[typeddict-item]
    assert reply.content[0].text == "ok"
    prompt = template.decode(engine.log.prompts[0])
    assert prompt.startswith("<|im_start|>system\nTop system.\n\nInner system.<|im_end|>")


def test_count_tokens_and_head_probe(proxy: Any, engine: ScriptedEngine) -> None:
    session = proxy.new_session()
    c = client(session)
    counted = c.messages.count_tokens(model="policy", messages=[{"role": "user", "content": "hi"}], tools=TOOLS)
    c.messages.create(model="policy", max_tokens=10, messages=[{"role": "user", "content": "hi"}], tools=TOOLS)
    assert counted.input_tokens == len(engine.log.prompts[0])
    assert httpx.head(session["urls"]["anthropic"]).status_code == 200
    assert httpx.head(f"{proxy.url}/s/no-such-key").status_code == 401


def test_errors_in_anthropic_shape(proxy: Any, engine: ScriptedEngine) -> None:
    session = proxy.new_session()
    bad = anthropic.Anthropic(base_url=proxy.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as auth:
        bad.messages.create(model="p", max_tokens=5, messages=[{"role": "user", "content": "hi"}])
    assert auth.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.BadRequestError) as long:
        client(session).messages.create(model="p", max_tokens=5, messages=[{"role": "user", "content": "word " * 5000}])
    assert long.value.body["error"]["message"].startswith("prompt is too long:")
    engine.down = True
    with pytest.raises(anthropic.APIStatusError) as down:
        client(session).messages.create(model="p", max_tokens=5, messages=[{"role": "user", "content": "hi"}])
    assert down.value.status_code == 503 and down.value.body["type"] == "error"


def test_late_system_message_is_a_user_turn_and_history_still_merges(
    proxy: Any, engine: ScriptedEngine, template: Any
) -> None:
    session = proxy.new_session()
    c = client(session)
    engine.push("First.", "Second.")
    history: list[dict[str, Any]] = [{"role": "user", "content": "one"}]
    c.messages.create(model="p", max_tokens=50, system="Sys.", messages=history)  # type: ignore[arg-type]
    history += [
        {"role": "assistant", "content": "First."},
        {"role": "system", "content": "Reminder."},
        {"role": "user", "content": "two"},
    ]
    c.messages.create(model="p", max_tokens=50, system="Sys.", messages=history)  # type: ignore[arg-type]
    assert template.decode(engine.log.prompts[1]).startswith("<|im_start|>system\nSys.<|im_end|>")
    assert "<|im_start|>user\nReminder.<|im_end|>" in template.decode(engine.log.prompts[1])
    assert [c["merged"] for c in proxy.trajectory(session["key"])["calls"]] == [False, True]
