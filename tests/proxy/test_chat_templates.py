"""Chat templates and tool-call formats users bring: a Llama-3-style template
with JSON tool calls end to end, a template that renders no tools (refused
with a 400 naming the fix in every dialect, warned at start-up), a template
file that replaces the tokenizer's, and templates that fail at load with a
message that says what to do."""

from __future__ import annotations

import copy
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from legorl_jax.core.config import ProxyConfig
from legorl_jax.models.tokenizer import load_chat_template
from rollout_server.proxy.app import build_app
from rollout_server.proxy.engine_client import ProxyEngineClient
from rollout_server.proxy.render import ChatTemplate
from rollout_server.proxy.service import ProxyCore, build_core, load_template
from rollout_server.proxy.session import SessionSpec, SessionStore

from .chat_formats import BASH, CHATML_NO_TOOLS_TEMPLATE, build_llama_style_tokenizer, with_template
from .conftest import checked_renders
from .scripted_engine import ScriptedEngine, ServerThread

FIX = "--chat-template FILE"


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_llama_style_tokenizer(tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def no_tools_dir(tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo tokenizer with a ChatML template that ignores tools (as SmolLM2-Instruct's does)."""
    return with_template(tokenizer_dir, CHATML_NO_TOOLS_TEMPLATE, tmp_path_factory.mktemp("no_tools"))


def test_llama3_json_template_renders_tools_and_the_calls_come_back_parsed(
    llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import AutoTokenizer

    engine = ScriptedEngine(AutoTokenizer.from_pretrained(llama_dir), end_token="<|eot_id|>")
    with ServerThread(engine.app) as engine_server:
        core = build_core(
            llama_dir,
            engine_server.url,
            served_model="scripted",
            max_context=4096,
            config=ProxyConfig(tool_call_format="llama3_json"),
        )
        assert core.template.renders_tools and core.template.incremental
        incremental = checked_renders(core.template, monkeypatch)
        session = core.store.create(SessionSpec())
        engine.push(
            '<|python_tag|>{"name": "bash", "parameters": {"command": "ls; pwd"}}; '
            '{"name": "bash", "parameters": {"command": "id"}}',
            "Two files.",
        )
        with ServerThread(build_app(core)) as server:
            client = openai.OpenAI(base_url=f"{server.url}/s/{session.key}/v1", api_key="unused", max_retries=0)
            messages: list[dict[str, Any]] = [{"role": "user", "content": "List the files."}]
            reply = client.chat.completions.create(model="m", messages=messages, tools=[BASH])
            calls = reply.choices[0].message.tool_calls or []
            assert reply.choices[0].finish_reason == "tool_calls"
            assert [json.loads(c.function.arguments) for c in calls] == [{"command": "ls; pwd"}, {"command": "id"}]
            messages += [
                reply.choices[0].message.model_dump(exclude_none=True),
                *({"role": "tool", "tool_call_id": c.id, "content": "a.txt"} for c in calls),
            ]
            final = client.chat.completions.create(model="m", messages=messages, tools=[BASH])
    assert final.choices[0].message.content == "Two files."
    first, second = engine.log.prompts
    assert '"name": "bash", "description": "Run a shell command."' in engine.tokenizer.decode(first)
    # The sampled turn, `<|python_tag|>` and all, is reused token for token: one sequence, all trained.
    assert second[: len(first) + len(engine.log.replies[0]["token_ids"])] == first + engine.log.replies[0]["token_ids"]
    assert len(session.trajectory.sequences) == 1 and session.trajectory.metrics()["tool_calls"] == 2
    assert len(incremental) == 1  # the second call rendered only its new part, as a full render does


@pytest.fixture()
def no_tools_proxy(
    no_tools_dir: Path,
    engine: ScriptedEngine,
    _engine_server: tuple[ScriptedEngine, str],
    caplog: pytest.LogCaptureFixture,
) -> Iterator[tuple[str, str]]:
    """(proxy URL, a session key) of a proxy whose chat template renders no tools."""
    with caplog.at_level(logging.WARNING, logger="rollout_server.proxy.service"):
        template = load_template(no_tools_dir, ProxyConfig())
    assert not template.renders_tools
    warning = caplog.records[-1].getMessage()
    assert "renders no tools" in warning and "refused (400)" in warning and FIX in warning
    core = ProxyCore(template, ProxyEngineClient(_engine_server[1], "scripted"), SessionStore(), max_context=4096)
    with ServerThread(build_app(core)) as server:
        yield server.url, core.store.create(SessionSpec()).key


def _dialect_calls(tools: bool) -> dict[str, tuple[str, dict[str, Any]]]:
    """One request per dialect (path, body), with the bash tool or without tools."""
    schema = {"type": "object", "properties": {"command": {"type": "string"}}}
    return {
        "openai": (
            "/v1/chat/completions",
            {"model": "m", "messages": [{"role": "user", "content": "hi"}], **({"tools": [BASH]} if tools else {})},
        ),
        "responses": (
            "/v1/responses",
            {
                "model": "m",
                "input": "hi",
                **(
                    {"tools": [{"type": "function", "name": "bash", "description": "Run.", "parameters": schema}]}
                    if tools
                    else {}
                ),
            },
        ),
        "anthropic": (
            "/v1/messages",
            {
                "model": "m",
                "max_tokens": 64,
                "messages": [{"role": "user", "content": "hi"}],
                **({"tools": [{"name": "bash", "description": "Run.", "input_schema": schema}]} if tools else {}),
            },
        ),
        "gemini": (
            "/v1beta/models/m:generateContent",
            {
                "contents": [{"role": "user", "parts": [{"text": "hi"}]}],
                **(
                    {
                        "tools": [
                            {"functionDeclarations": [{"name": "bash", "description": "Run.", "parameters": schema}]}
                        ]
                    }
                    if tools
                    else {}
                ),
            },
        ),
    }


def _message(dialect: str, body: dict[str, Any]) -> str:
    """The error message where each provider's error shape keeps it."""
    if dialect == "anthropic":
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
        return body["error"]["message"]
    if dialect == "gemini":
        assert body["error"]["status"] == "INVALID_ARGUMENT" and body["error"]["code"] == 400
    return body["error"]["message"]


def test_template_without_tools_refuses_tool_requests_in_every_dialect(
    no_tools_proxy: tuple[str, str], engine: ScriptedEngine
) -> None:
    url, key = no_tools_proxy
    for dialect, (path, body) in _dialect_calls(tools=True).items():
        reply = httpx.post(f"{url}/s/{key}{path}", json=body, timeout=30)
        assert reply.status_code == 400, (dialect, reply.text)
        message = _message(dialect, reply.json())
        assert "renders none" in message and FIX in message and "proxy.chat_template" in message, dialect
    assert engine.log.prompts == []  # nothing reached the engine
    # Without tools the same template serves every dialect.
    for dialect, (path, body) in _dialect_calls(tools=False).items():
        assert httpx.post(f"{url}/s/{key}{path}", json=body, timeout=30).status_code == 200, dialect
    assert len(engine.log.prompts) == 4


def test_chat_template_file_replaces_the_tokenizers(
    no_tools_dir: Path, tmp_path: Path, engine: ScriptedEngine, _engine_server: tuple[ScriptedEngine, str]
) -> None:
    template_file = tmp_path / "tools.jinja"
    template_file.write_text(load_chat_template(), encoding="utf-8")
    core = build_core(
        no_tools_dir,
        _engine_server[1],
        served_model="scripted",
        max_context=4096,
        config=ProxyConfig(chat_template=str(template_file)),
    )
    assert core.template.renders_tools
    session = core.store.create(SessionSpec())
    with ServerThread(build_app(core)) as server:
        client = openai.OpenAI(base_url=f"{server.url}/s/{session.key}/v1", api_key="unused", max_retries=0)
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], tools=[BASH])
    assert "<tools>" in engine.tokenizer.decode(engine.log.prompts[0])
    (tmp_path / "empty.jinja").write_text(" \n")
    for path, error in ((tmp_path / "nope.jinja", "nope.jinja"), (tmp_path / "empty.jinja", "is empty")):
        with pytest.raises(ValueError, match=error):
            load_template(no_tools_dir, ProxyConfig(chat_template=str(path)))


@pytest.mark.parametrize(
    "source, problem",
    [
        (None, "the tokenizer has none"),
        # A template that refuses tool messages (strict user/assistant alternation) cannot carry an agent's loop.
        (
            "{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('roles must alternate') }}{% endif %}"
            "{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{% endfor %}"
            "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}",
            "roles must alternate",
        ),
        (
            "{% for m in messages %}{{ m.role + ': ' + m.content + '\\n' }}{% endfor %}"
            "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}",
            "do not end with a special token",
        ),
        (
            "{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{% endfor %}",
            "generation prompt does not extend",
        ),
    ],
)
def test_unusable_template_fails_at_load_saying_how_to_replace_it(
    tokenizer: Any, source: str | None, problem: str
) -> None:
    broken = copy.deepcopy(tokenizer)
    broken.chat_template = source
    with pytest.raises(ValueError, match=problem) as caught:
        ChatTemplate(broken)
    assert FIX in str(caught.value) and "proxy.chat_template" in str(caught.value)


def test_tool_call_format_the_template_does_not_write_is_warned_at_load(
    llama_dir: Path, tokenizer_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The model learnt its calls from its template: a parser that cannot read
    them would pass every call to the harness as text."""
    with caplog.at_level(logging.WARNING, logger="rollout_server.proxy.service"):
        load_template(llama_dir, ProxyConfig(tool_call_format="llama3_json"))
        load_template(tokenizer_dir, ProxyConfig(tool_call_format="hermes"))
        assert caplog.records == []
        load_template(llama_dir, ProxyConfig())
    (warning,) = caplog.records
    assert "'hermes' does not read" in warning.getMessage() and "llama3_json does" in warning.getMessage()
    assert '<|python_tag|>{"name": "f", "parameters": {"a": "v"}}' in warning.getMessage()
