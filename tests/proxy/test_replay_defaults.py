"""The request streams the installed CLIs send, replayed in order through
`legorl proxy` started with no config (the schema's defaults) in front of
`legorl serve` with a long context, as a new user runs them (issue 42: with
the demo's caps, five of eleven real streams were refused at their second
or third call). Each stream is recorded first, from the CLI itself, against
a proxy in front of the scripted engine (`test_real_harnesses`)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from rollout_server.proxy.app import build_app
from rollout_server.proxy.engine_client import ProxyEngineClient
from rollout_server.proxy.render import ChatTemplate
from rollout_server.proxy.service import ProxyCore
from rollout_server.proxy.session import SessionStore

from .conftest import ADMIN_TOKEN, Proxy
from .scripted_engine import ScriptedEngine, ServerThread
from .test_proxy_cmd import legorl, wait_for_log
from .test_real_harnesses import HARNESSES, run_cli_session

pytestmark = [pytest.mark.npm, pytest.mark.slow]

# As the engine was run; Claude Code's first prompt alone is ~25k tokens of the demo tokenizer.
SERVED_CONTEXT = 98_304
# What the replay samples per call: the tiny random model never ends a completion by itself.
REPLAY_MAX_TOKENS = 4
_FORWARDED = (b"content-type", b"content-encoding")


@dataclass
class Recorded:
    """One model call as the CLI sent it: path after `/s/<key>`, query, headers to forward, body."""

    path: str
    query: bytes
    headers: dict[str, str]
    body: bytes


class Recorder:
    """ASGI middleware: every POST under a session's `/s/<key>/` as it arrived, in order."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.calls: list[Recorded] = []

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or scope["method"] != "POST" or not path.startswith("/s/"):
            return await self.app(scope, receive, send)
        headers = {k.decode(): v.decode() for k, v in scope["headers"] if k in _FORWARDED}
        body = bytearray()

        async def recording_receive() -> dict[str, Any]:
            message = await receive()
            if message["type"] == "http.request":
                body.extend(message.get("body", b""))
                if not message.get("more_body"):
                    rest = path.split("/", 3)[3]  # "", "s", key, rest
                    self.calls.append(Recorded("/" + rest, scope["query_string"], headers, bytes(body)))
            return message

        await self.app(scope, recording_receive, send)


@pytest.fixture(scope="module")
def recording_proxy(
    _engine_server: tuple[ScriptedEngine, str], template: ChatTemplate
) -> Iterator[tuple[Proxy, Recorder]]:
    """A proxy in front of the scripted engine (as `test_real_harnesses`'), and what reached it."""
    _, engine_url = _engine_server
    core = ProxyCore(template, ProxyEngineClient(engine_url, "scripted"), SessionStore(), max_context=65536)
    recorder = Recorder(build_app(core, keepalive_s=0.2, admin_token=ADMIN_TOKEN))
    with ServerThread(recorder) as server:
        yield Proxy(server.url, core), recorder


@pytest.fixture(scope="module")
def default_proxy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`legorl serve` on a tiny random model with a long context, and `legorl proxy` before it with no
    config; the proxy's URL (admin token "t")."""
    from legorl_jax.models.demo_assets import build_tiny_hf_model

    root = tmp_path_factory.mktemp("replay")
    model = build_tiny_hf_model(root / "model", max_position_embeddings=SERVED_CONTEXT)
    with legorl("serve", ["--model", str(model), "--max-num-seqs", "2"], root / "serve.log") as serve:
        (engine,) = wait_for_log(serve, root / "serve.log", r"Uvicorn running on (http://\S+)")
        args = ["--engine-url", engine.group(1), "--model", str(model), "--admin-token", "t"]
        with legorl("proxy", args, root / "proxy.log") as proxy:
            (found,) = wait_for_log(proxy, root / "proxy.log", r"Uvicorn running on (http://\S+)")
            assert f"context {SERVED_CONTEXT}" in (root / "proxy.log").read_text()
            yield found.group(1)


@pytest.mark.parametrize("name", sorted(HARNESSES))
def test_a_cli_stream_replays_through_the_default_proxy(
    recording_proxy: tuple[Proxy, Recorder], engine: ScriptedEngine, default_proxy: str, tmp_path: Path, name: str
) -> None:
    proxy, recorder = recording_proxy
    recorder.calls.clear()
    run_cli_session(proxy, engine, tmp_path, name)
    stream = list(recorder.calls)
    assert len(stream) >= 3, [c.path for c in stream]
    admin = {"authorization": "Bearer t"}
    # The session's sampling cap only bounds what the random model writes; every other cap is the proxy's default.
    spec = {"sampling": {"max_tokens": REPLAY_MAX_TOKENS}, "seed": 1}
    key = httpx.post(f"{default_proxy}/admin/sessions", json=spec, headers=admin).json()["key"]
    with httpx.Client(timeout=600) as client:
        for i, call in enumerate(stream):
            url = f"{default_proxy}/s/{key}{call.path}" + (f"?{call.query.decode()}" if call.query else "")
            reply = client.post(url, content=call.body, headers=call.headers)
            assert reply.status_code == 200, f"call {i + 1} of {len(stream)} ({call.path}): {reply.text[:500]}"
            assert "session limit" not in reply.text and "event: error" not in reply.text, reply.text[:500]
    traj = httpx.get(f"{default_proxy}/admin/sessions/{key}/trajectory", headers=admin).json()
    metrics = traj["metrics"]
    assert metrics["cap_hit"] is None and metrics["model_calls"] == len(stream), metrics
    # Each of the task's calls renders the conversation so far as the call before it did, then more:
    # the prefix that, with the engine's own replies (not the recorded ones), the proxy would merge.
    main = [c for c in traj["calls"] if not c["side"] and not c["merged"]]
    prompts = [traj["sequences"][c["sequence"]]["token_ids"][: c["prompt_tokens"]] for c in main]
    assert len(prompts) >= 3
    for before, after in zip(prompts, prompts[1:], strict=False):
        assert len(after) > len(before) and after[: len(before)] == before
    print(f"{name}: {len(stream)} calls, {metrics['prompt_tokens']} prompt tokens, longest {len(prompts[-1])}")
