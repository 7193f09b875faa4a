"""Shared test plumbing for lego episodes: the file-edit task, scripted solutions and a runner."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from rollout_server.harnesses import HarnessContext, InProcessHarness, get_harness
from rollout_server.harnesses.lego import LegoResult
from rollout_server.sandbox.base import AGENT_USER, Sandbox

from .scripted_chat_server import Reply, ScriptedChatServer, call

TASK = "In greeting.txt, replace the word world with there."

SOLUTIONS: dict[str, list[Reply]] = {
    "bash_only": [
        Reply(tool_calls=[call("bash", command="sed -i 's/world/there/' greeting.txt")]),
        Reply(content="Replaced the word."),
    ],
    "edit_tools": [
        Reply(content="Let me look.", tool_calls=[call("view_file", path="greeting.txt")]),
        Reply(tool_calls=[call("str_replace", path="greeting.txt", old="world", new="there")]),
        Reply(tool_calls=[call("submit", summary="Replaced world with there.")]),
    ],
    "minimal": [
        Reply(tool_calls=[call("run", command="printf 'hello there\\n' > greeting.txt")]),
        Reply(tool_calls=[call("submit", summary="Rewrote the file.")]),
    ],
}


def put(sandbox: Sandbox, name: str, text: str) -> None:
    """Create a workspace file as the agent user, as a task's starting state would be."""
    result = sandbox.exec(["sh", "-c", 'printf %s "$1" > "$2"', "sh", text, name], timeout=30, user=AGENT_USER)
    assert result.ok, result


def get(sandbox: Sandbox, tmp_path: Path, name: str) -> str:
    dst = tmp_path / f"out-{name.replace('/', '_')}"
    sandbox.copy_out(f"/app/{name}", dst)
    return dst.read_text()


def run(
    sandbox: Sandbox,
    server: ScriptedChatServer,
    replies: list[Reply],
    options: dict[str, Any] | None = None,
    *,
    session_url: str | None = None,
    deadline_s: float = 60.0,
) -> LegoResult:
    server.load(replies)
    harness = get_harness("lego")
    assert isinstance(harness, InProcessHarness)
    ctx = HarnessContext(
        session_url=session_url or server.session_url,
        api_key=server.key,
        model="tiny-policy",
        instruction=TASK,
        workdir="/app",
    )
    result = asyncio.run(harness.run(sandbox, ctx, harness.parse_options(options or {}), deadline_s=deadline_s))
    assert isinstance(result, LegoResult)
    return result


def tool_messages(request: dict[str, Any]) -> list[str]:
    return [m["content"] for m in request["messages"] if m["role"] == "tool"]
