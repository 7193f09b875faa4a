from __future__ import annotations

from collections.abc import Iterator

import pytest
from proxy.scripted_engine import ServerThread

from rollout_server.sandbox.base import SandboxSpec
from rollout_server.sandbox.local import LocalSandbox

from .scripted_chat_server import ScriptedChatServer


@pytest.fixture(scope="session")
def chat_server() -> Iterator[ScriptedChatServer]:
    server = ScriptedChatServer()
    with ServerThread(server.app) as thread:
        server.base_url = thread.url
        yield server


@pytest.fixture
def sandbox() -> Iterator[LocalSandbox]:
    # A generous process limit: RLIMIT_NPROC counts every process of this (shared) user id.
    box = LocalSandbox(SandboxSpec(trial_id="harness-test", environment_dir=None, pids_limit=4096, wall_clock_s=120))
    box.start()
    yield box
    box.stop()
