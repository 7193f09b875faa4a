"""lego against the real token-capture proxy (in front of the proxy suite's scripted engine).

This is the seam that matters for training: lego's history must be append-only
and byte-exact so the proxy merges a whole episode into one token sequence,
and the proxy's refusals must end the episode with the right status.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from proxy.scripted_engine import ScriptedEngine, ServerThread
from transformers import AutoTokenizer

from legorl_jax.core.config import SessionCaps
from legorl_jax.models.tokenizer import build_demo_tokenizer
from rollout_server.harnesses import HarnessContext, get_harness
from rollout_server.harnesses.lego import LegoResult
from rollout_server.proxy.app import build_app
from rollout_server.proxy.engine_client import ProxyEngineClient
from rollout_server.proxy.render import ChatTemplate
from rollout_server.proxy.service import ProxyCore
from rollout_server.proxy.session import Session, SessionSpec, SessionStore
from rollout_server.sandbox.local import LocalSandbox


class Stack:
    def __init__(self, engine: ScriptedEngine, core: ProxyCore, url: str) -> None:
        self.engine, self.core, self.url = engine, core, url


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tokenizer = AutoTokenizer.from_pretrained(build_demo_tokenizer(tmp_path_factory.mktemp("tokenizer")))
    engine = ScriptedEngine(tokenizer)
    with ServerThread(engine.app) as engine_server:
        core = ProxyCore(
            ChatTemplate(tokenizer), ProxyEngineClient(engine_server.url, "scripted"), SessionStore(), max_context=4096
        )
        with ServerThread(build_app(core, keepalive_s=0.2)) as proxy_server:
            yield Stack(engine, core, proxy_server.url)


def hermes_call(name: str, **arguments: Any) -> str:
    """Engine text for one tool call in the Hermes format the proxy parses (Qwen3's)."""
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def run(stack: Stack, sandbox: LocalSandbox, session: Session, options: dict[str, Any]) -> LegoResult:
    harness = get_harness("lego")
    ctx = HarnessContext(
        session_url=f"{stack.url}/s/{session.key}",
        api_key=session.key,
        model="scripted",
        instruction="In greeting.txt, replace world with there.",
    )
    return asyncio.run(harness.run(sandbox, ctx, harness.parse_options(options), deadline_s=60))


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_episode_through_the_proxy_is_one_captured_sequence(
    stack: Stack, sandbox: LocalSandbox, tmp_path: Path, stream: bool
) -> None:
    (tmp_path / "greeting.txt").write_text("hello world\n")
    sandbox.copy_in(tmp_path / "greeting.txt", "/app/greeting.txt")
    stack.engine.reset()
    stack.engine.push(
        hermes_call("view_file", path="greeting.txt"),
        hermes_call("str_replace", path="greeting.txt", old="world", new="there"),
        hermes_call("submit", summary="done"),
    )
    session = stack.core.store.create(SessionSpec(), None)
    result = run(stack, sandbox, session, {"tools": "edit_tools", "stream": stream})

    assert (result.status, result.stop_reason, result.tool_errors, result.turns) == ("ok", "submitted", 0, 3)
    sandbox.copy_out("/app/greeting.txt", tmp_path / "out.txt")
    assert (tmp_path / "out.txt").read_text() == "hello there\n"
    trajectory = session.trajectory.to_json()
    assert [c["merged"] for c in trajectory["calls"]] == [False, True, True]
    (sequence,) = trajectory["sequences"]
    sampled = [t for t, m in zip(sequence["token_ids"], sequence["loss_mask"], strict=True) if m]
    assert sampled == [t for reply in stack.engine.log.replies for t in reply["token_ids"]]


def test_summarising_starts_a_new_sequence(stack: Stack, sandbox: LocalSandbox) -> None:
    stack.engine.reset()
    stack.engine.push(
        hermes_call("bash", command="seq 1 400"),
        "I printed the numbers 1 to 400.",  # the summary
        "Nothing left to do.",
    )
    session = stack.core.store.create(SessionSpec(), None)
    options = {"tools": "bash_only", "context": "summarize", "context_budget_chars": 1000, "observation": "raw"}
    result = run(stack, sandbox, session, options)
    assert (result.status, result.stop_reason, result.compactions) == ("ok", "answered", 1)
    trajectory = session.trajectory.to_json()
    # The summary call has no tool list, so its prompt renders differently, and the restart rewrites
    # the history: each starts a new sequence, and every sampled token is still captured once.
    assert [c["merged"] for c in trajectory["calls"]] == [False, False, False]
    sampled = [
        t for seq in trajectory["sequences"] for t, m in zip(seq["token_ids"], seq["loss_mask"], strict=True) if m
    ]
    assert sampled == [t for reply in stack.engine.log.replies for t in reply["token_ids"]]


def test_session_cap_ends_the_episode_as_cap_exceeded(stack: Stack, sandbox: LocalSandbox) -> None:
    stack.engine.reset()
    stack.engine.push(*[hermes_call("bash", command="true")] * 3)
    session = stack.core.store.create(SessionSpec(caps=SessionCaps(max_model_calls=2)), None)
    result = run(stack, sandbox, session, {"tools": "bash_only"})
    assert (result.status, result.stop_reason, result.turns) == ("cap_exceeded", "cap_exceeded", 2)
    assert "session limit" in result.reason
