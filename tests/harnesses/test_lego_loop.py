"""The lego loop end to end: scripted model replies, tool calls executed in a real local sandbox."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from rollout_server.harnesses.lego.prompts import PLAN_REQUEST, SUMMARY_PREFIX, SUMMARY_REQUEST
from rollout_server.harnesses.lego.tools import TOOL_SETS
from rollout_server.proxy.dialects.openai_chat import openai_error
from rollout_server.proxy.errors import ErrorKind, ProxyError
from rollout_server.sandbox.local import LocalSandbox

from .episodes import SOLUTIONS, TASK, get, put, run, tool_messages
from .scripted_chat_server import Reply, ScriptedChatServer, call


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("tools", sorted(SOLUTIONS))
def test_solves_file_edit_with_each_tool_set(
    sandbox: LocalSandbox, chat_server: ScriptedChatServer, tmp_path: Path, tools: str, stream: bool
) -> None:
    put(sandbox, "greeting.txt", "hello world\n")
    result = run(sandbox, chat_server, SOLUTIONS[tools], {"tools": tools, "stream": stream})

    assert get(sandbox, tmp_path, "greeting.txt") == "hello there\n"
    assert (result.status, result.tool_errors) == ("ok", 0)
    assert result.stop_reason == ("answered" if tools == "bash_only" else "submitted")
    assert result.turns == len(SOLUTIONS[tools]) == len(chat_server.requests)
    assert result.tool_calls == len(SOLUTIONS[tools]) - (tools == "bash_only")
    first = chat_server.requests[0]
    assert [t["function"]["name"] for t in first["tools"]] == list(TOOL_SETS[tools])
    assert bool(first.get("stream")) is stream
    assert first["messages"][1] == {"role": "user", "content": TASK}
    if tools == "edit_tools":
        # The view_file observation reached the model, numbered.
        assert "     1\thello world" in tool_messages(chat_server.requests[1])[0]
        assert result.final_message == "Replaced world with there."


def test_assistant_history_keeps_raw_arguments(
    sandbox: LocalSandbox, chat_server: ScriptedChatServer, tmp_path: Path
) -> None:
    # The proxy matches earlier turns by their tool calls: the loop must echo them byte for byte.
    spaced = '{"command":   "true"}'
    run(sandbox, chat_server, [Reply(tool_calls=[("bash", spaced)]), Reply(content="ok")], {"tools": "bash_only"})
    echoed = chat_server.requests[1]["messages"][2]
    assert echoed["tool_calls"][0]["function"]["arguments"] == spaced


def test_write_file_moves_large_unicode_content_intact(
    sandbox: LocalSandbox, chat_server: ScriptedChatServer, tmp_path: Path
) -> None:
    content = "".join(f"line {i}: ünïcødé ✓ $HOME `x` 'q' \"d\"\n" for i in range(4000))  # > 2 write chunks
    replies = [Reply(tool_calls=[call("write_file", path="sub/dir/big.txt", content=content)]), Reply(content="ok")]
    result = run(sandbox, chat_server, replies, {"tools": "edit_tools"})
    assert result.tool_errors == 0
    assert get(sandbox, tmp_path, "sub/dir/big.txt") == content


def test_malformed_tool_calls_become_counted_error_observations(
    sandbox: LocalSandbox, chat_server: ScriptedChatServer
) -> None:
    bad = Reply(
        tool_calls=[
            ("launch_rockets", "{}"),
            ("bash", "{not json"),
            ("bash", '{"cmd": "ls"}'),
            call("str_replace", path="missing.txt", old="a", new="b"),
        ]
    )
    result = run(sandbox, chat_server, [bad, Reply(tool_calls=[call("submit")])], {"tools": "edit_tools"})
    assert (result.status, result.stop_reason) == ("ok", "submitted")
    assert (result.tool_calls, result.tool_errors) == (5, 4)
    errors = tool_messages(chat_server.requests[1])
    assert len(errors) == 4 and all(e.startswith("error: ") for e in errors)
    assert "unknown tool 'launch_rockets'" in errors[0] and "submit" in errors[0]
    assert "not valid JSON" in errors[1]
    assert "command" in errors[2] and "cmd" in errors[2]
    assert "cannot read missing.txt" in errors[3]


def test_file_tools_refuse_files_they_would_corrupt(
    sandbox: LocalSandbox, chat_server: ScriptedChatServer, tmp_path: Path
) -> None:
    (tmp_path / "blob.bin").write_bytes(b"\xff\xfeab\x00cd")
    sandbox.copy_in(tmp_path / "blob.bin", "/app/blob.bin")
    replies = [Reply(tool_calls=[call("str_replace", path="blob.bin", old="ab", new="xy")]), Reply(content="ok")]
    result = run(sandbox, chat_server, replies, {"tools": "edit_tools"})
    assert result.tool_errors == 1
    assert "not a UTF-8 text file" in tool_messages(chat_server.requests[1])[0]
    sandbox.copy_out("/app/blob.bin", tmp_path / "after.bin")
    assert (tmp_path / "after.bin").read_bytes() == b"\xff\xfeab\x00cd"


def test_turn_budget_is_respected(sandbox: LocalSandbox, chat_server: ScriptedChatServer) -> None:
    forever = [Reply(tool_calls=[call("bash", command=f"echo {i}")]) for i in range(30)]
    result = run(sandbox, chat_server, forever, {"tools": "bash_only", "turn_budget": "short"})
    assert (result.status, result.stop_reason) == ("ok", "turn_budget")
    assert result.turns == 6 == len(chat_server.requests)


def test_summarize_compacts_and_restarts_from_the_summary(
    sandbox: LocalSandbox, chat_server: ScriptedChatServer
) -> None:
    replies = [
        Reply(tool_calls=[call("bash", command="seq 1 600")]),  # ~2.3 KB of output: over budget
        Reply(content="I printed 1..600."),  # the summary
        Reply(tool_calls=[call("bash", command="echo after")]),
        Reply(content="done"),
    ]
    options = {"tools": "bash_only", "context": "summarize", "context_budget_chars": 1000, "observation": "raw"}
    result = run(sandbox, chat_server, replies, options)
    assert (result.status, result.compactions, result.turns, result.model_calls) == ("ok", 1, 3, 4)
    summary_request = chat_server.requests[1]
    assert "tools" not in summary_request
    assert summary_request["messages"][-1] == {"role": "user", "content": SUMMARY_REQUEST}
    restarted = chat_server.requests[2]["messages"]
    assert [m["role"] for m in restarted] == ["system", "user", "user"]
    assert restarted[2]["content"] == SUMMARY_PREFIX + "I printed 1..600."


def test_prompt_too_long_compacts_under_summarize_and_ends_otherwise(
    sandbox: LocalSandbox, chat_server: ScriptedChatServer
) -> None:
    too_long = proxy_error("prompt_too_long", "prompt is too long")
    first = Reply(tool_calls=[call("bash", command="echo hi")])
    result = run(
        sandbox,
        chat_server,
        [first, too_long, Reply(content="summary"), Reply(content="done")],
        {"tools": "bash_only", "context": "summarize"},
    )
    assert (result.status, result.stop_reason, result.compactions) == ("ok", "answered", 1)

    result = run(sandbox, chat_server, [first, too_long], {"tools": "bash_only", "context": "full"})
    assert (result.status, result.stop_reason) == ("ok", "context_exhausted")


def test_window_sends_task_and_last_turns(sandbox: LocalSandbox, chat_server: ScriptedChatServer) -> None:
    replies = [Reply(tool_calls=[call("bash", command=f"echo {i}")]) for i in range(4)] + [Reply(content="done")]
    run(sandbox, chat_server, replies, {"tools": "bash_only", "context": "window", "window_turns": 2})
    last = chat_server.requests[-1]["messages"]
    assert [m["role"] for m in last] == ["system", "user", "user", "assistant", "tool", "assistant", "tool"]
    assert "2 earlier turns" in last[2]["content"]
    assert [m["content"].strip() for m in last if m["role"] == "tool"] == ["2", "3"]


def test_plan_first_asks_for_a_plan_without_tools(sandbox: LocalSandbox, chat_server: ScriptedChatServer) -> None:
    replies = [Reply(content="1. edit 2. submit"), Reply(tool_calls=[call("submit")])]
    result = run(sandbox, chat_server, replies, {"prompt": "plan_first"})
    assert (result.status, result.turns, result.model_calls) == ("ok", 1, 2)
    plan_request, act_request = chat_server.requests
    assert "tools" not in plan_request and plan_request["messages"][-1]["content"] == PLAN_REQUEST
    assert "tools" in act_request
    assert {"role": "assistant", "content": "1. edit 2. submit"} in act_request["messages"]


def test_tool_timeout_is_reported_to_the_model(sandbox: LocalSandbox, chat_server: ScriptedChatServer) -> None:
    replies = [Reply(tool_calls=[call("bash", command="sleep 5")]), Reply(content="gave up")]
    options = {"tools": "bash_only", "tool_timeout_s": 0.5, "observation": "structured"}
    result = run(sandbox, chat_server, replies, options)
    assert result.status == "ok"
    assert tool_messages(chat_server.requests[1])[0].startswith("exit_code: timeout")


def proxy_error(kind: ErrorKind, message: str) -> Reply:
    """An error exactly as the token-capture proxy renders it on its chat-completions route."""
    err = ProxyError(kind, message, prompt_tokens=5000, max_context=4096)
    return Reply(status=err.status, error=openai_error(err)["error"])


@pytest.mark.parametrize(
    ("reply", "status"),
    [
        (Reply(status=500, error={"message": "internal error"}), "harness_error"),
        (proxy_error("engine_unavailable", "engine down"), "harness_error"),
        (Reply(status=429, error={"message": "too many calls"}), "cap_exceeded"),
        (proxy_error("cap_exceeded", "session limit reached: model_calls"), "cap_exceeded"),
        (proxy_error("invalid_request", "messages[3]: expected dict"), "harness_error"),
    ],
)
def test_proxy_errors_map_to_statuses(
    sandbox: LocalSandbox, chat_server: ScriptedChatServer, reply: Reply, status: str
) -> None:
    result = run(sandbox, chat_server, [Reply(tool_calls=[call("bash", command="true")]), reply])
    assert result.status == status
    assert result.stop_reason == ("cap_exceeded" if status == "cap_exceeded" else "proxy_error")
    assert result.turns == 1 and result.reason


def test_rejected_session_key_is_cap_exceeded(sandbox: LocalSandbox, chat_server: ScriptedChatServer) -> None:
    wrong = chat_server.session_url.replace(chat_server.key, "revoked-key")
    result = run(sandbox, chat_server, [Reply(content="never sent")], session_url=wrong)
    assert (result.status, result.turns) == ("cap_exceeded", 0)
    assert "401" in result.reason


def test_unreachable_proxy_is_harness_error(sandbox: LocalSandbox, chat_server: ScriptedChatServer) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again before use: nothing listens there
    result = run(sandbox, chat_server, [], session_url=f"http://127.0.0.1:{port}/s/{chat_server.key}")
    assert (result.status, result.stop_reason) == ("harness_error", "proxy_error")
    assert "cannot reach the proxy" in result.reason


def test_deadline_ends_the_episode_as_timeout(sandbox: LocalSandbox, chat_server: ScriptedChatServer) -> None:
    replies = [Reply(tool_calls=[call("bash", command="sleep 2")]), Reply(content="late")]
    result = run(sandbox, chat_server, replies, {"tools": "bash_only", "tool_timeout_s": 2}, deadline_s=0.5)
    assert (result.status, result.stop_reason) == ("timeout", "timeout")


def test_result_metrics_are_numbers(sandbox: LocalSandbox, chat_server: ScriptedChatServer) -> None:
    result = run(sandbox, chat_server, [Reply(content="nothing to do")], {"tools": "bash_only"})
    assert result.stop_reason == "answered" and result.final_message == "nothing to do"
    metrics = result.metrics()
    assert metrics["turns"] == 1 and metrics["tool_calls"] == 0
    json.dumps(metrics)
    assert result.config_id == "bash_only.guided.full.truncated.medium"
