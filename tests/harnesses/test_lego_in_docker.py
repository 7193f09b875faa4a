"""lego's tools inside a real Docker sandbox (the base image, agent user, no network).

The loop itself runs on the host; what this checks is that every tool works
with only what a task image guarantees (sh, coreutils) and as the agent user.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import docker
import pytest

from rollout_server.sandbox.base import SandboxSpec
from rollout_server.sandbox.docker import DockerSandbox
from rollout_server.sandbox.images import BASE_IMAGE, ensure_base_image

from .episodes import SOLUTIONS, get, put, run, tool_messages
from .scripted_chat_server import Reply, ScriptedChatServer, call

pytestmark = pytest.mark.docker


@pytest.fixture
def docker_box() -> Iterator[DockerSandbox]:
    client = docker.from_env(timeout=120)
    ensure_base_image(client)
    spec = SandboxSpec(trial_id=f"lego-{uuid.uuid4().hex[:8]}", environment_dir=None, docker_image=BASE_IMAGE)
    box = DockerSandbox(spec, client, network=None)
    box.start()
    yield box
    box.stop()


@pytest.mark.parametrize("tools", sorted(SOLUTIONS))
def test_file_edit_in_docker(
    docker_box: DockerSandbox, chat_server: ScriptedChatServer, tmp_path: Path, tools: str
) -> None:
    put(docker_box, "greeting.txt", "hello world\n")
    result = run(docker_box, chat_server, SOLUTIONS[tools], {"tools": tools})
    assert (result.status, result.tool_errors) == ("ok", 0), tool_messages(chat_server.requests[-1])
    assert get(docker_box, tmp_path, "greeting.txt") == "hello there\n"


def test_write_and_view_large_file_in_docker(
    docker_box: DockerSandbox, chat_server: ScriptedChatServer, tmp_path: Path
) -> None:
    content = "".join(f"row {i}: ünïcødé ✓ $HOME `x`\n" for i in range(6000))
    replies = [
        Reply(tool_calls=[call("write_file", path="deep/dir/big.txt", content=content)]),
        Reply(tool_calls=[call("view_file", path="deep/dir/big.txt", start_line=5999, end_line=6000)]),
        Reply(content="ok"),
    ]
    result = run(docker_box, chat_server, replies, {"tools": "edit_tools"})
    assert result.tool_errors == 0, tool_messages(chat_server.requests[-1])
    assert get(docker_box, tmp_path, "deep/dir/big.txt") == content
    viewed = tool_messages(chat_server.requests[2])[1]
    assert "  5999\trow 5998" in viewed and "  6000\trow 5999" in viewed
