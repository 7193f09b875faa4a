"""`build_core`: a proxy assembled from a model directory and the proxy config."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import openai

from legorl_jax.core.config import ProxyConfig
from rollout_server.proxy.app import build_app
from rollout_server.proxy.service import build_core
from rollout_server.proxy.session import SessionSpec

from .scripted_engine import ScriptedEngine, ServerThread


def test_build_core_applies_the_proxy_config(
    engine: ScriptedEngine, _engine_server: tuple[ScriptedEngine, str], tokenizer: Any, tmp_path: Path
) -> None:
    tokenizer.save_pretrained(tmp_path)
    core = build_core(
        tmp_path,
        _engine_server[1],
        served_model="scripted",
        max_context=4096,
        config=ProxyConfig(max_model_calls=7, tool_call_format="qwen3_coder"),
    )
    engine.push("<tool_call>\n<function=bash>\n<parameter=command>\nls\n</parameter>\n</function>\n</tool_call>")
    session = core.store.create(SessionSpec())
    assert session.spec.caps is not None and session.spec.caps.max_model_calls == 7
    with ServerThread(build_app(core)) as server:
        client = openai.OpenAI(base_url=f"{server.url}/s/{session.key}/v1", api_key="unused", max_retries=0)
        reply = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "go"}])
    call = reply.choices[0].message.tool_calls[0]  # type: ignore[index]
    assert call.function.arguments == '{"command": "ls"}'  # type: ignore[union-attr]
    assert session.trajectory.metrics()["tool_calls"] == 1
