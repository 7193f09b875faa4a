"""Incremental rendering (a session's PrefixMemo) gives the ids a full render
gives: multi-turn tool loops in every dialect, each render of the third call
on checked against a full render (the `incremental_renders` fixture), and
templates whose text after a turn depends on earlier messages never take the
incremental path."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from rollout_server.proxy.conversation import ChatRequest, Message, ToolCall
from rollout_server.proxy.render import ChatTemplate, PrefixMemo, Prompt, SampledTurn

from .chat_formats import BASH
from .scripted_engine import ScriptedEngine
from .test_anthropic import CACHE
from .test_gemini import TOOLS as GEMINI_TOOLS
from .test_openai_chat import assert_captured, call_text

TURNS = 4


@dataclass(frozen=True)
class Wire:
    """One dialect's tool loop: the route, the first request body, how a
    reply's tool call is read, and how the call and its result go back."""

    path: str
    start: Callable[[], dict[str, Any]]
    call_of: Callable[[dict[str, Any]], tuple[str, dict[str, Any]]]  # (id, arguments)
    append: Callable[[dict[str, Any], str, dict[str, Any], str], None]  # body, id, arguments, result


def _chat_append(body: dict[str, Any], cid: str, args: dict[str, Any], result: str) -> None:
    body["messages"] += [  # compact arguments, as OpenCode re-serialises them
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": cid,
                    "type": "function",
                    "function": {"name": "bash", "arguments": json.dumps(args, separators=(",", ":"))},
                }
            ],
        },
        {"role": "tool", "tool_call_id": cid, "content": result},
    ]


def _chat_call(reply: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    call = reply["choices"][0]["message"]["tool_calls"][0]
    return call["id"], json.loads(call["function"]["arguments"])


def _anthropic_append(body: dict[str, Any], cid: str, args: dict[str, Any], result: str) -> None:
    for message in body["messages"]:  # the cache marker moves to the newest block
        for block in message["content"] if isinstance(message["content"], list) else []:
            block.pop("cache_control", None)
    body["messages"] += [
        {"role": "assistant", "content": [{"type": "tool_use", "id": cid, "name": "bash", "input": args}]},
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": cid,
                    "content": [{"type": "text", "text": result, "cache_control": CACHE}],
                }
            ],
        },
    ]


def _anthropic_call(reply: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    use = next(b for b in reply["content"] if b["type"] == "tool_use")
    return use["id"], use["input"]


def _responses_append(body: dict[str, Any], cid: str, args: dict[str, Any], result: str) -> None:
    body["input"] += [
        {"type": "function_call", "call_id": cid, "name": "bash", "arguments": json.dumps(args)},
        {"type": "function_call_output", "call_id": cid, "output": result},
    ]


def _responses_call(reply: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    call = next(i for i in reply["output"] if i["type"] == "function_call")
    return call["call_id"], json.loads(call["arguments"])


def _gemini_append(body: dict[str, Any], cid: str, args: dict[str, Any], result: str) -> None:
    body["contents"] += [  # thought parts dropped, as Gemini CLI does
        {"role": "model", "parts": [{"functionCall": {"name": "bash", "args": args}}]},
        {"role": "user", "parts": [{"functionResponse": {"name": "bash", "response": {"output": result}}}]},
    ]


def _gemini_call(reply: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    part = next(p for p in reply["candidates"][0]["content"]["parts"] if "functionCall" in p)
    return "", part["functionCall"]["args"]


_GEMINI_BASH = copy.deepcopy(GEMINI_TOOLS)
_GEMINI_BASH[0]["functionDeclarations"][0]["name"] = "bash"

WIRES = {
    "openai_chat": Wire(
        "/v1/chat/completions",
        lambda: {
            "model": "m",
            "tools": [BASH],
            "messages": [
                {"role": "system", "content": "You are a coding agent."},
                {"role": "user", "content": "Fix the bug."},
            ],
        },
        _chat_call,
        _chat_append,
    ),
    "anthropic": Wire(
        "/v1/messages",
        lambda: {
            "model": "m",
            "max_tokens": 512,
            "system": "You are Claude Code.",
            "tools": [{"name": "bash", "description": "Run.", "input_schema": BASH["function"]["parameters"]}],
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "Fix the bug.", "cache_control": CACHE}]}
            ],
        },
        _anthropic_call,
        _anthropic_append,
    ),
    "openai_responses": Wire(
        "/v1/responses",
        lambda: {
            "model": "m",
            "tools": [
                {
                    "type": "function",
                    "name": "bash",
                    "description": "Run.",
                    "parameters": BASH["function"]["parameters"],
                }
            ],
            "input": [
                {"type": "message", "role": "developer", "content": "You are Codex."},
                {"type": "message", "role": "user", "content": "Fix the bug."},
            ],
        },
        _responses_call,
        _responses_append,
    ),
    "gemini": Wire(
        "/v1beta/models/policy:generateContent",
        lambda: {
            "contents": [{"role": "user", "parts": [{"text": "Fix the bug."}]}],
            "tools": _GEMINI_BASH,
            "systemInstruction": {"parts": [{"text": "You are Gemini CLI."}]},
        },
        _gemini_call,
        _gemini_append,
    ),
}


@pytest.mark.parametrize("dialect", sorted(WIRES))
def test_tool_loop_renders_incrementally_and_token_exactly(
    proxy: Any, engine: ScriptedEngine, dialect: str, incremental_renders: list[Any]
) -> None:
    wire = WIRES[dialect]
    key = proxy.new_session()["key"]
    engine.push(*(call_text("bash", {"command": f"step {i}"}, thought=f"think {i}") for i in range(TURNS)), "Done.")
    body = wire.start()
    for turn in range(TURNS):
        reply = httpx.post(f"{proxy.url}{wire.path}", json=body, headers={"x-api-key": key}, timeout=30)
        assert reply.status_code == 200, reply.text
        cid, args = wire.call_of(reply.json())
        assert args == {"command": f"step {turn}"}
        wire.append(body, cid, args, f"output {turn}\n" * 3)
    assert httpx.post(f"{proxy.url}{wire.path}", json=body, headers={"x-api-key": key}, timeout=30).status_code == 200
    # Calls 2.. extend a memo (the turn the call before sampled); each was checked against a full render.
    assert len(incremental_renders) == TURNS
    traj = proxy.trajectory(key)
    assert all(c["merged"] for c in traj["calls"][1:]) and len(traj["sequences"]) == 1
    assert_captured(traj["sequences"][0], engine)


def _turn(template: ChatTemplate, index: int, text: str) -> SampledTurn:
    from rollout_server.proxy.conversation import AssistantOutput

    ids = (*template.encode(text), template.turn_end_id)
    return SampledTurn(index, ids, (1,) * len(ids), (-0.5,) * len(ids), AssistantOutput(text, None, ()))


def _grow(template: ChatTemplate, turns: list[SampledTurn], memo: PrefixMemo) -> tuple[list[Message], Prompt]:
    """A conversation [system, q0, answer 0, q1, ...] rendered call by call
    with `memo`, each render from the second on incremental and the same as
    a full render; returns the messages and the last full render."""
    messages = [Message("system", "sys"), Message("user", "q0")]
    for i in range(len(turns)):
        messages += [Message("assistant", f"answer {i}"), Message("user", f"q{i + 1}")]
        matched = {2 * j + 2: t for j, t in enumerate(turns[: i + 1])}
        prompt = template.render(ChatRequest(list(messages)), matched, True, memo)
        assert prompt.incremental == (i > 0)
        full = template.render(ChatRequest(list(messages)), matched, True)
        assert (prompt.ids, prompt.reused_spans) == (full.ids, full.reused_spans)
    return messages, full


def test_memo_is_dropped_when_history_changes_or_a_turn_is_re_rendered(template: ChatTemplate) -> None:
    turns = [_turn(template, i, f"<think>\nplan {i}\n</think>\n\nanswer {i}") for i in range(3)]
    memo = PrefixMemo()
    messages, _ = _grow(template, turns, memo)
    # An earlier user message edited: the memo no longer applies.
    edited = [*messages[:3], Message("user", "q1 edited"), *messages[4:]]
    matched = {2 * j + 2: t for j, t in enumerate(turns)}
    assert not template.render(ChatRequest(edited), matched, True, memo).incremental
    # A turn that comes back unmatched (re-rendered from text, reasoning and all) renders in full, and clears the memo.
    rewritten = [*messages, Message("assistant", "typed by hand", reasoning="why"), Message("user", "q4")]
    assert not template.render(ChatRequest(rewritten), matched, True, memo).incremental
    assert not memo.valid
    assert not template.render(ChatRequest(list(messages)), matched, True, memo).incremental


def test_template_with_non_local_turns_never_renders_incrementally(tokenizer: Any) -> None:
    numbered = copy.deepcopy(tokenizer)
    # Each turn shows how many messages the conversation holds: the text after a turn depends on what came before.
    numbered.chat_template = tokenizer.chat_template.replace(
        '"<|im_start|>user\\n" ~ content', '"<|im_start|>user\\n" ~ (messages | length) ~ content'
    )
    assert numbered.chat_template != tokenizer.chat_template
    template = ChatTemplate(numbered)
    assert not template.incremental and ChatTemplate(tokenizer).incremental
    turn = _turn(template, 0, "hi")
    memo = PrefixMemo()
    for extra in range(3):
        messages = [
            Message("user", "q"),
            Message("assistant", "hi"),
            *[Message("user", f"u{j}") for j in range(extra + 1)],
        ]
        assert not template.render(ChatRequest(messages), {1: turn}, True, memo).incremental


def test_template_whose_turns_read_the_system_message_keeps_it_in_incremental_renders(tokenizer: Any) -> None:
    """The demo template's text after a turn ignores the system message, so
    incremental renders leave it out; one whose user turns repeat the system
    text keeps it, and both match a full render id for id."""
    reading = copy.deepcopy(tokenizer)
    system_text = '(messages[0].content if messages[0].role == "system" else "")'
    reading.chat_template = tokenizer.chat_template.replace(
        '"<|im_start|>user\\n" ~ content', f'"<|im_start|>user\\n" ~ {system_text} ~ content'
    )
    assert reading.chat_template != tokenizer.chat_template
    plain, system_reading = ChatTemplate(tokenizer), ChatTemplate(reading)
    assert plain._suffix_without_system and not system_reading._suffix_without_system
    for template in (plain, system_reading):
        assert template.incremental
        _, full = _grow(template, [_turn(template, i, f"answer {i}") for i in range(3)], PrefixMemo())
        # The reading template's user turns really carry the system text: leaving it out would change the ids.
        assert ("sysq3" in template.decode(full.ids)) == (template is system_reading)


def test_tool_call_turns_with_reused_ids_keep_their_places(template: ChatTemplate) -> None:
    call = ToolCall("c1", "bash", {"command": "ls"})
    turn = _turn(template, 0, '<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>')
    turn2 = _turn(template, 1, "done")
    memo = PrefixMemo()
    base = [Message("user", "q"), Message("assistant", "", tool_calls=[call]), Message("tool", "a", tool_call_id="c1")]
    first = template.render(ChatRequest(base), {1: turn}, True, memo)
    longer = [
        *base,
        Message("assistant", "done"),
        Message("tool", "b", tool_call_id="c2"),
        Message("tool", "c", tool_call_id="c3"),
    ]
    second = template.render(ChatRequest(longer), {1: turn, 3: turn2}, True, memo)
    assert second.incremental and second.ids[: len(first.ids)] == first.ids
    assert [(at, t.index) for at, t in second.reused_spans] == [(first.reused_spans[0][0], 0), (len(first.ids), 1)]
    assert second.ids[len(first.ids) : len(first.ids) + len(turn2.ids)] == list(turn2.ids)


def test_memo_moves_on_to_the_turn_the_call_sampled(template: ChatTemplate) -> None:
    """After a call, the next one renders from the turn it sampled: only that
    turn and what came after it, with the ids a full render gives."""
    assert template._prompts_extend
    memo = PrefixMemo()
    messages = [Message("system", "sys"), Message("user", "q0")]
    first = template.render(ChatRequest(list(messages)), {}, True, memo)
    assert not first.incremental and not memo.valid  # no reused turn to keep yet
    turn = _turn(template, 0, "answer 0")
    template.remember_sampled(memo, ChatRequest(list(messages)), {}, True, first, turn)
    assert memo.ids[: len(first.ids)] == tuple(first.ids) and memo.turns == {2: 0}
    messages += [Message("assistant", "answer 0, as the harness wrote it back"), Message("user", "q1")]
    second = template.render(ChatRequest(messages), {2: turn}, True, memo)
    full = template.render(ChatRequest(messages), {2: turn}, True)
    assert second.incremental and (second.ids, second.reused_spans) == (full.ids, full.reused_spans)
    # A call that rendered a turn from text (history rewritten) leaves the memo where its render left it.
    rewritten = [Message("user", "q0"), Message("assistant", "typed by hand"), Message("user", "q1")]
    prompt = template.render(ChatRequest(rewritten), {}, True, memo)
    assert prompt.unmatched_turns == 1 and not memo.valid
    template.remember_sampled(memo, ChatRequest(rewritten), {}, True, prompt, _turn(template, 1, "answer 1"))
    assert not memo.valid


# The last user message marked always, or only when no tools are given (the check renders both ways).
@pytest.mark.parametrize("mark", ['("." if loop.last else "")', '("." if loop.last and not tools else "")'])
def test_template_whose_prompts_differ_from_the_history_keeps_the_memo_at_reused_turns(
    tokenizer: Any, mark: str
) -> None:
    """A template whose last message renders differently from the same
    message further back: the prompt a turn was sampled for is no prefix of
    the later conversation, so the memo is not moved on to sampled turns,
    and every render still matches a full one."""
    marking = copy.deepcopy(tokenizer)
    marking.chat_template = tokenizer.chat_template.replace(
        '"<|im_start|>user\\n" ~ content ~ "<|im_end|>\\n"',
        f'"<|im_start|>user\\n" ~ content ~ {mark} ~ "<|im_end|>\\n"',
    )
    assert marking.chat_template != tokenizer.chat_template
    template = ChatTemplate(marking)
    assert template.incremental and not template._prompts_extend
    memo = PrefixMemo()
    messages = [Message("user", "q0")]
    first = template.render(ChatRequest(list(messages)), {}, True, memo)
    template.remember_sampled(memo, ChatRequest(list(messages)), {}, True, first, _turn(template, 0, "a0"))
    assert not memo.valid
    _, full = _grow(template, [_turn(template, i, f"answer {i}") for i in range(3)], PrefixMemo())
    assert "q3." in template.decode(full.ids) and "q2." not in template.decode(full.ids)
