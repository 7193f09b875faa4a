"""TEST INSTRUMENT: a chat teacher served in the test: our proxy (OpenAI Chat
Completions and Anthropic Messages) over the scripted test engine, with a
tokenizer of its own, unlike the student's (the demo tokenizer), and one
session whose key is the teacher's API key. Not product code."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from rollout_server.proxy.app import build_app
from rollout_server.proxy.engine_client import ProxyEngineClient
from rollout_server.proxy.render import ChatTemplate
from rollout_server.proxy.service import ProxyCore
from rollout_server.proxy.session import SessionStore

from .scripted_engine import ScriptedEngine, ServerThread

TEACHER_KEY = "teacher-key-0123456789"
_ADMIN_TOKEN = "teacher-admin-token"


def teacher_tokenizer(directory: Path) -> Any:
    """The demo's format with another vocabulary: other ids for the same text."""
    from transformers import AutoTokenizer

    from legorl_jax.models.tokenizer import build_demo_tokenizer

    return AutoTokenizer.from_pretrained(build_demo_tokenizer(directory, vocab_size=700))


@contextmanager
def teacher_server(tokenizer: Any, max_context: int = 8192) -> Iterator[tuple[ScriptedEngine, str]]:
    """The scripted engine the teacher answers from, and the teacher's URL."""
    engine = ScriptedEngine(tokenizer, max_model_len=max_context)
    with ServerThread(engine.app) as engine_server:
        engine_client = ProxyEngineClient(engine_server.url, "teacher")
        core = ProxyCore(ChatTemplate(tokenizer), engine_client, SessionStore(), max_context=max_context)
        with ServerThread(build_app(core, admin_token=_ADMIN_TOKEN)) as server:
            created = httpx.post(
                f"{server.url}/admin/sessions",
                json={"key": TEACHER_KEY},
                headers={"authorization": f"Bearer {_ADMIN_TOKEN}"},
            )
            assert created.status_code == 201, created.text
            yield engine, server.url
