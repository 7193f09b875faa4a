"""Trajectory assembly through the proxy: token-exact merging, sampled-id
reuse where re-rendering would differ, new roots with their reasons."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from .chat_formats import BASH
from .scripted_engine import Scripted, ScriptedEngine, fake_prompt_logprob
from .test_openai_chat import assert_captured, call_text


def chat(proxy: Any, key: str, messages: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    reply = httpx.post(
        f"{proxy.url}/v1/chat/completions",
        headers={"authorization": f"Bearer {key}"},
        json={"model": "m", "messages": messages, **extra},
        timeout=30,
    )
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["message"]


def extends(engine: ScriptedEngine, call: int) -> bool:
    """Whether prompt `call` starts with prompt `call - 1` + its completion."""
    before = engine.log.prompts[call - 1] + engine.log.replies[call - 1]["token_ids"]
    return engine.log.prompts[call][: len(before)] == before


def test_new_query_keeps_sampled_reasoning_the_template_would_drop(
    proxy: Any, engine: ScriptedEngine, template: Any
) -> None:
    key = proxy.new_session()["key"]
    engine.push("<think>\nsecret plan\n</think>\n\nHello.", "Bye.")
    history = [{"role": "user", "content": "hi"}]
    first = chat(proxy, key, history)
    assert first["content"] == "Hello." and first["reasoning_content"] == "secret plan"
    # The harness sends the answer back without its reasoning, then asks again.
    history += [{"role": "assistant", "content": "Hello."}, {"role": "user", "content": "bye"}]
    chat(proxy, key, history)
    assert extends(engine, 1)
    # Re-rendering the text would have lost the thought: the ids were reused, not re-tokenized.
    rerendered = template.tokenizer.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
    assert "secret plan" not in rerendered
    assert "secret plan" in template.decode(engine.log.prompts[1])
    traj = proxy.trajectory(key)
    assert [c["merged"] for c in traj["calls"]] == [False, True]
    assert traj["calls"][1]["reused_turns"] == 1
    assert_captured(traj["sequences"][0], engine)


def test_thinking_off_and_length_cut_still_extend(proxy: Any, engine: ScriptedEngine, template: Any) -> None:
    key = proxy.new_session(enable_thinking=False)["key"]
    engine.push(Scripted("A long answer that gets cut", finish="length"), "Short.")
    history = [{"role": "user", "content": "go"}]
    cut = chat(proxy, key, history, max_tokens=3)
    assert engine.log.bodies[0]["max_tokens"] == 3
    history += [{"role": "assistant", "content": cut["content"]}, {"role": "user", "content": "again"}]
    chat(proxy, key, history)
    assert extends(engine, 1)
    seq = proxy.trajectory(key)["sequences"][0]
    # The turn-end token the engine never sampled sits in the sequence with mask 0.
    end_at = len(engine.log.prompts[0]) + 3
    assert seq["token_ids"][end_at] == template.turn_end_id and seq["loss_mask"][end_at] == 0
    assert template.decode(engine.log.prompts[0]).endswith("<think>\n\n</think>\n\n")
    assert_captured(seq, engine)


def test_rewritten_history_starts_new_root_without_retraining(proxy: Any, engine: ScriptedEngine) -> None:
    key = proxy.new_session()["key"]
    engine.push("First.", "Second.")
    chat(proxy, key, [{"role": "user", "content": "q"}])
    chat(
        proxy,
        key,
        [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "Edited by harness."},
            {"role": "user", "content": "q2"},
        ],
    )
    traj = proxy.trajectory(key)
    assert [s["root_reason"] for s in traj["sequences"]] == ["first_call", "history_rewritten"]
    assert traj["calls"][1]["unmatched_turns"] == 1
    # Each sampled token is trained once, in the sequence that sampled it.
    second = traj["sequences"][1]
    assert sum(second["loss_mask"]) == len(engine.log.replies[1]["token_ids"])


def test_side_call_and_restart_are_flagged(proxy: Any, engine: ScriptedEngine) -> None:
    key = proxy.new_session()["key"]
    main = [{"role": "system", "content": "main agent"}, {"role": "user", "content": "task"}]
    chat(proxy, key, main, tools=[BASH])
    chat(proxy, key, [{"role": "system", "content": "Write a title."}, {"role": "user", "content": "task"}])
    chat(proxy, key, main, tools=[BASH])
    traj = proxy.trajectory(key)
    assert [(s["root_reason"], s["side"]) for s in traj["sequences"]] == [
        ("first_call", False),
        ("side_call", True),
        ("restart", False),
    ]
    assert traj["metrics"]["side_calls"] == 1 and traj["metrics"]["new_roots"]["restart"] == 1


def test_repeated_identical_answers_map_to_their_own_turns(proxy: Any, engine: ScriptedEngine) -> None:
    key = proxy.new_session()["key"]
    engine.push(
        call_text("bash", {"command": "ls"}, thought="one"), call_text("bash", {"command": "ls"}, thought="two"), "done"
    )
    history: list[dict[str, Any]] = [{"role": "user", "content": "list twice"}]
    for _ in range(2):
        message = chat(proxy, key, history, tools=[BASH])
        # No ids come back (as from a harness that drops them): matched by name and arguments.
        history += [
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {"id": "", "type": "function", "function": {"name": "bash", "arguments": '{"command": "ls"}'}}
                ],
            },
            {"role": "tool", "tool_call_id": "x", "content": "a"},
        ]
        assert message["tool_calls"][0]["function"]["name"] == "bash"
    chat(proxy, key, history, tools=[BASH])
    assert extends(engine, 1) and extends(engine, 2)
    traj = proxy.trajectory(key)
    assert traj["metrics"]["merged_ratio"] == 2 / 3 and len(traj["sequences"]) == 1
    assert_captured(traj["sequences"][0], engine)


@pytest.mark.parametrize("recompute", [True, False])
def test_rewritten_history_recomputes_logprobs_of_reused_turns(
    proxy: Any, engine: ScriptedEngine, recompute: bool
) -> None:
    key = proxy.new_session(recompute_logprobs=recompute)["key"]
    engine.push("First.", "Second.", "Third.")
    chat(proxy, key, [{"role": "user", "content": "q"}])
    history = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "First."},
        {"role": "user", "content": "q2"},
    ]
    chat(proxy, key, history)
    # The harness edits an earlier user message (a compaction): both sampled turns come back intact.
    history[2]["content"] = "q2, shortened"
    chat(proxy, key, [*history, {"role": "assistant", "content": "Second."}, {"role": "user", "content": "q3"}])
    assert ["prompt_logprobs" in b for b in engine.log.bodies] == [False, False, recompute]
    traj = proxy.trajectory(key)
    assert [s["root_reason"] for s in traj["sequences"]] == ["first_call", "history_rewritten"]
    assert traj["calls"][2]["reused_turns"] == 2
    reused = engine.log.replies[0]["token_ids"] + engine.log.replies[1]["token_ids"]
    assert traj["metrics"]["recomputed_tokens"] == (len(reused) if recompute else 0)
    assert traj["metrics"]["recomputed_calls"] == int(recompute)
    new = traj["sequences"][1]
    trained = [
        (at, t, lp)
        for at, (t, m, lp) in enumerate(zip(new["token_ids"], new["loss_mask"], new["behavior_logprobs"], strict=True))
        if m
    ]
    own = [(t, lp) for t, lp in zip(engine.log.replies[2]["token_ids"], engine.log.replies[2]["logprobs"], strict=True)]
    prompt_len = len(engine.log.prompts[2])
    assert [(t, lp) for at, t, lp in trained if at >= prompt_len] == own
    earlier = [(at, t, lp) for at, t, lp in trained if at < prompt_len]
    # With recompute: the reused sampled tokens, in order, with the engine's prompt logprobs at their positions.
    assert [t for _, t, _ in earlier] == (reused if recompute else [])
    assert all(lp == fake_prompt_logprob(at, t) for at, t, lp in earlier)
    # The first sequence still holds them with their sampling-time logprobs.
    assert_captured(traj["sequences"][0], _only(engine, 2))


def test_short_prompt_logprobs_are_a_503_and_the_session_goes_on(proxy: Any, engine: ScriptedEngine) -> None:
    key = proxy.new_session(recompute_logprobs=True)["key"]
    engine.push("First.", "Second.", "Third.")
    chat(proxy, key, [{"role": "user", "content": "q"}])
    rewritten = [
        {"role": "user", "content": "q, edited"},
        {"role": "assistant", "content": "First."},
        {"role": "user", "content": "q2"},
    ]
    engine.drop_prompt_logprob = True
    reply = httpx.post(
        f"{proxy.url}/v1/chat/completions",
        headers={"authorization": f"Bearer {key}"},
        json={"model": "m", "messages": rewritten},
        timeout=30,
    )
    assert reply.status_code == 503 and "prompt logprobs" in reply.json()["error"]["message"]
    engine.drop_prompt_logprob = False
    chat(proxy, key, rewritten)
    traj = proxy.trajectory(key)
    assert len(traj["calls"]) == 2 and traj["calls"][1]["recomputed_tokens"] == len(engine.log.replies[0]["token_ids"])


def _only(engine: ScriptedEngine, calls: int) -> ScriptedEngine:
    """The engine as it was after its first `calls` calls, for assert_captured."""
    view = ScriptedEngine(engine.tokenizer)
    view.log.replies = engine.log.replies[:calls]
    return view
