"""A chat teacher as the proxy's engine: a real server with a chat API, here our
own proxy (OpenAI Chat Completions and Anthropic Messages) in front of the
scripted test engine, with a tokenizer of its own unlike the student's. The
student's proxy calls it through the providers' SDKs, answers the harness with
the teacher's message, and records the turn as the student's template writes
it, marked re-rendered, logprobs 0."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from legorl_jax.core.config import ConfigError, load_config
from rollout_server.backends.client import EngineError
from rollout_server.proxy.app import build_app
from rollout_server.proxy.chat_teacher import ChatTeacher, TeacherApi, TeacherEngine, chat_teacher
from rollout_server.proxy.conversation import AssistantOutput, ChatRequest, Message
from rollout_server.proxy.render import ChatTemplate
from rollout_server.proxy.service import ProxyCore
from rollout_server.proxy.session import SessionStore

from .chat_formats import BASH, with_template
from .chat_teacher_server import TEACHER_KEY, teacher_server, teacher_tokenizer
from .conftest import ADMIN_TOKEN, MAX_CONTEXT
from .scripted_engine import ScriptedEngine, ServerThread

TOOLS = [BASH]
CALL_TEXT = '<tool_call>\n{"name": "bash", "arguments": {"command": "ls -la"}}\n</tool_call>'
ADMIN = {"authorization": f"Bearer {ADMIN_TOKEN}"}


@pytest.fixture(scope="module")
def teacher(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ScriptedEngine, str]]:
    with teacher_server(teacher_tokenizer(tmp_path_factory.mktemp("teacher"))) as served:
        yield served


def _student(template: ChatTemplate, api: TeacherApi, url: str, key: str) -> ServerThread:
    teacher = ChatTeacher(api, url, "teacher-model", key, max_retries=0)
    core = ProxyCore(template, teacher, SessionStore(), max_context=MAX_CONTEXT)
    return ServerThread(build_app(core, admin_token=ADMIN_TOKEN))


def _session(url: str) -> str:
    created = httpx.post(f"{url}/admin/sessions", json={}, headers=ADMIN)
    assert created.status_code == 201, created.text
    return str(created.json()["key"])


def _chat(url: str, key: str, messages: list[dict[str, Any]]) -> httpx.Response:
    body = {"model": "m", "messages": messages, "tools": TOOLS}
    return httpx.post(f"{url}/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"}, timeout=60)


def _turn_text(tokenizer: Any, messages: list[dict[str, Any]], turn: dict[str, Any]) -> str:
    """The assistant turn as the student's template writes it after the prompt, up to its turn end."""
    prompt = tokenizer.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    full = tokenizer.apply_chat_template([*messages, turn], tools=TOOLS, tokenize=False)
    assert full.startswith(prompt)
    end = full.index("<|im_end|>", len(prompt)) + len("<|im_end|>")
    return str(full[len(prompt) : end])


@pytest.mark.parametrize("api", ["openai_chat", "anthropic"])
def test_a_teachers_turns_reach_the_harness_and_are_recorded_as_the_student_writes_them(
    api: TeacherApi, teacher: tuple[ScriptedEngine, str], template: ChatTemplate, tokenizer: Any
) -> None:
    engine, teacher_url = teacher
    engine.reset()
    engine.push(CALL_TEXT, "All files listed.")
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a careful agent."},
        {"role": "user", "content": "List the files."},
    ]
    with _student(template, api, teacher_url, TEACHER_KEY) as student:
        key = _session(student.url)
        first = _chat(student.url, key, messages)
        assert first.status_code == 200, first.text
        message = first.json()["choices"][0]["message"]
        (call,) = message["tool_calls"]
        assert call["function"]["name"] == "bash" and call["function"]["arguments"] == '{"command": "ls -la"}'
        # The harness sends the teacher's turn back with the tool's result: the turn is matched, not re-rendered.
        messages += [message, {"role": "tool", "tool_call_id": call["id"], "content": "a.txt"}]
        second = _chat(student.url, key, messages)
        assert second.status_code == 200, second.text
        assert second.json()["choices"][0]["message"]["content"] == "All files listed."
        trajectory = httpx.get(f"{student.url}/admin/sessions/{key}/trajectory", headers=ADMIN).json()

    # The teacher saw the conversation in its own tokens: nothing of the student's ids crossed.
    assert len(engine.log.prompts) == 2
    (seq,) = trajectory["sequences"]  # the second call extends the first token for token
    assert [c["rerendered"] for c in trajectory["calls"]] == [True, True]
    assert trajectory["calls"][1]["merged"] is True
    mask, ids = seq["loss_mask"], seq["token_ids"]
    spans = [i for i, bit in enumerate(mask) if bit]
    assert all(seq["behavior_logprobs"][i] == 0.0 for i in spans)  # none are the student's
    turns = []
    for start in (i for i in spans if not mask[i - 1]):
        end = next((j for j in range(start, len(mask)) if not mask[j]), len(mask))
        turns.append(tokenizer.decode(ids[start:end]))
    tool_call = {"type": "function", "function": {"name": "bash", "arguments": {"command": "ls -la"}}}
    assert turns == [
        _turn_text(tokenizer, messages[:2], {"role": "assistant", "content": "", "tool_calls": [tool_call]}),
        _turn_text(tokenizer, messages, {"role": "assistant", "content": "All files listed."}),
    ]


@pytest.mark.parametrize("api", ["openai_chat", "anthropic"])
def test_a_refused_key_is_a_clear_error_at_once(
    api: TeacherApi, teacher: tuple[ScriptedEngine, str], template: ChatTemplate
) -> None:
    _, teacher_url = teacher
    with _student(template, api, teacher_url, "wrong-key-0123456789") as student:
        key = _session(student.url)
        started = time.monotonic()
        refused = _chat(student.url, key, [{"role": "user", "content": "hi"}])
        assert time.monotonic() - started < 10
        # The harness gets the proxy's 503, with the teacher's own words; the proxy serves on.
        assert refused.status_code == 503
        error = refused.json()["error"]["message"]
        assert f"chat teacher ({api} at {teacher_url})" in error and "401" in error, error
        assert "wrong-key" not in error
        assert httpx.get(f"{student.url}/admin/sessions/{key}/trajectory", headers=ADMIN).status_code == 200


def test_a_teacher_has_no_logprobs_to_recompute(template: ChatTemplate) -> None:
    with _student(template, "openai_chat", "http://127.0.0.1:9", "k") as student:
        refused = httpx.post(f"{student.url}/admin/sessions", json={"recompute_logprobs": True}, headers=ADMIN)
    assert refused.status_code == 400 and "chat teacher" in refused.text


def test_a_rollout_server_on_a_teacher_has_no_weights_and_needs_its_key(monkeypatch: pytest.MonkeyPatch) -> None:
    settings = ["engine.kind=openai_chat", "engine.url=http://127.0.0.1:9", "engine.teacher_model=m"]
    monkeypatch.delenv("TEACHER_KEY_UNSET", raising=False)
    with pytest.raises(ConfigError, match="engine.api_key_env: environment variable TEACHER_KEY_UNSET is unset"):
        chat_teacher(load_config(None, [*settings, "engine.api_key_env=TEACHER_KEY_UNSET"]).engine)
    engine = TeacherEngine(chat_teacher(load_config(None, settings).engine))
    assert asyncio.run(engine.healthy())
    with pytest.raises(EngineError, match=r"chat teacher \(openai_chat m at http://127.0.0.1:9\): it serves no policy"):
        asyncio.run(engine.update_weights("/weights/v1"))


@pytest.mark.parametrize("api", ["openai_chat", "anthropic"])
@pytest.mark.parametrize("thinking", [True, False])
def test_a_teachers_reasoning_is_written_where_the_students_prompt_leaves_room_for_it(
    api: TeacherApi, thinking: bool, teacher: tuple[ScriptedEngine, str], template: ChatTemplate, tokenizer: Any
) -> None:
    engine, teacher_url = teacher
    engine.reset()
    engine.push("<think>\nFirst look around.\n</think>\n\nHello.")
    with _student(template, api, teacher_url, TEACHER_KEY) as student:
        created = httpx.post(f"{student.url}/admin/sessions", json={"enable_thinking": thinking}, headers=ADMIN)
        key = created.json()["key"]
        answer = _chat(student.url, key, [{"role": "user", "content": "Hi."}])
        assert answer.status_code == 200, answer.text
        trajectory = httpx.get(f"{student.url}/admin/sessions/{key}/trajectory", headers=ADMIN).json()
    message = answer.json()["choices"][0]["message"]
    assert (message["content"], message["reasoning_content"]) == ("Hello.", "First look around.")  # as it came
    (seq,) = trajectory["sequences"]
    written = tokenizer.decode([t for t, bit in zip(seq["token_ids"], seq["loss_mask"], strict=True) if bit])
    # Thinking on, the student writes the thought; off, its prompt already holds an empty one, and the answer follows.
    assert written == ("<think>\nFirst look around.\n</think>\n\nHello.<|im_end|>" if thinking else "Hello.<|im_end|>")


def test_a_template_that_repeats_the_empty_think_block_in_the_turn_has_it_once(
    tokenizer_dir: Path, tmp_path: Path
) -> None:
    """Qwen3's template writes the last turn's think block even when empty, as its generation prompt
    does with thinking off: the turn's ids start after it, since the prompt holds it already."""
    from transformers import AutoTokenizer

    from legorl_jax.models.tokenizer import load_chat_template

    demo = load_chat_template()
    qwen3_like = demo.replace(
        '{%- if reasoning.strip("\\n") and loop.index0 > ns.last_query -%}',
        '{%- if loop.index0 > ns.last_query and (loop.last or reasoning.strip("\\n")) -%}',
    )
    assert qwen3_like != demo
    template = ChatTemplate(AutoTokenizer.from_pretrained(with_template(tokenizer_dir, qwen3_like, tmp_path / "q")))
    request = ChatRequest([Message("user", "Hi.")])
    output = AssistantOutput("Hello.", "First look around.", ())
    for thinking, written in ((False, "Hello."), (True, "<think>\nFirst look around.\n</think>\n\nHello.")):
        prompt = template.render(request, {}, thinking)
        ids = template.written_turn(request, {}, thinking, prompt.gen_tail, output)
        header = "<|im_start|>assistant\n" + ("" if thinking else "<think>\n\n</think>\n\n")
        assert template.decode(prompt.ids + ids).endswith(header + written + "<|im_end|>")
        assert template.decode(ids) == written + "<|im_end|>"
