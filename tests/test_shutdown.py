"""SIGTERM to `legorl serve` and `legorl proxy` while a request would run for
minutes: each drains for --shutdown-grace-s, then the client gets an error and
the process exits."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from legorl_jax.serve.drain import BackgroundServer

LEGORL = str(Path(sys.executable).with_name("legorl"))
GRACE_S = 2.0
# Start-up of a loaded machine aside, what exiting may take beyond the grace.
EXIT_SLACK_S = 6.0


def test_help_shows_the_grace_flag_and_its_default() -> None:
    for command in ("serve", "proxy"):
        text = subprocess.run([LEGORL, command, "--help"], capture_output=True, text=True, check=True).stdout
        assert "--shutdown-grace-s" in text and "(default: 10)" in text


class Process:
    """A `legorl` subprocess whose output goes to a log file, started at its URL."""

    def __init__(self, args: list[str], log_path: Path) -> None:
        self.log_path = log_path
        self._log = log_path.open("w")
        self.proc = subprocess.Popen(
            [LEGORL, *args, "--port", "0", "--shutdown-grace-s", str(GRACE_S)],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        self.url = self._wait_url()

    def _wait_url(self) -> str:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and self.proc.poll() is None:
            found = re.search(r"Uvicorn running on (http://\S+)", self.log_path.read_text())
            if found:
                return found.group(1)
            time.sleep(0.1)
        raise AssertionError(f"no URL; log:\n{self.log_path.read_text()}")

    def sigterm_and_time_exit(self) -> float:
        start = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout=GRACE_S + 60)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"still running after SIGTERM; log:\n{self.log_path.read_text()}") from None
        # uvicorn re-raises the signal it drained on: killed by SIGTERM, or 0.
        assert code in (0, -signal.SIGTERM), self.log_path.read_text()
        return time.monotonic() - start

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


def _in_thread(fn: Any) -> tuple[threading.Thread, list[Any]]:
    """Runs fn on a thread; its result (or exception) lands in the returned list."""
    result: list[Any] = []

    def run() -> None:
        try:
            result.append(fn())
        except Exception as exc:
            result.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, result


def test_legorl_serve_aborts_a_long_request_after_the_grace(model_dir: Path, tmp_path: Path) -> None:
    server = Process(
        ["serve", "--model", str(model_dir), "--max-num-seqs", "2", "--max-model-len", "32768"], tmp_path / "serve.log"
    )
    try:
        # ignore_eos and a 30k-token budget: minutes of decoding on this model.
        long = {"prompt": [11, 42, 7], "max_tokens": 30000, "ignore_eos": True}
        whole_thread, whole = _in_thread(lambda: httpx.post(f"{server.url}/v1/completions", json=long, timeout=120))
        events: list[str] = []
        first = threading.Event()

        def stream() -> None:
            body = {**long, "stream": True}
            with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=120) as reply:
                for line in reply.iter_lines():
                    events.append(line)
                    first.set()

        stream_thread, _ = _in_thread(stream)
        assert first.wait(120), server.log_path.read_text()
        elapsed = server.sigterm_and_time_exit()
        assert GRACE_S - 0.5 <= elapsed <= GRACE_S + EXIT_SLACK_S, elapsed
        whole_thread.join(10)
        stream_thread.join(10)
        reply = whole[0]
        assert isinstance(reply, httpx.Response) and reply.status_code == 503, reply
        assert "shutting down" in reply.json()["error"]["message"]
        data = [json.loads(e[6:]) for e in events if e.startswith("data: {")]
        assert "event: error" in events and "shutting down" in data[-1]["error"]["message"]
        assert len(data) > 1  # tokens were streamed before the abort
    finally:
        server.close()


class NeverAnswers:
    """TEST INSTRUMENT: an engine that lists a model and never answers a completion."""

    def __init__(self) -> None:
        self.called = threading.Event()
        self.app = Starlette(
            routes=[
                Route("/v1/models", self._models, methods=["GET"]),
                Route("/v1/completions", self._completions, methods=["POST"]),
            ]
        )

    async def _models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": "stuck", "object": "model", "max_model_len": 4096}]})

    async def _completions(self, request: Request) -> Response:
        self.called.set()
        await asyncio.sleep(3600)
        return Response(status_code=500)


@pytest.fixture()
def stuck_engine() -> Iterator[tuple[NeverAnswers, str]]:
    engine = NeverAnswers()
    server = BackgroundServer(engine.app, grace_s=0.5).start()
    try:
        yield engine, server.url
    finally:
        server.stop()


def test_legorl_proxy_aborts_a_call_the_engine_never_answers(
    stuck_engine: tuple[NeverAnswers, str], model_dir: Path, tmp_path: Path
) -> None:
    engine, engine_url = stuck_engine
    proxy = Process(
        ["proxy", "--engine-url", engine_url, "--model", str(model_dir), "--admin-token", "t"], tmp_path / "proxy.log"
    )
    try:
        made = httpx.post(f"{proxy.url}/admin/sessions", json={}, headers={"authorization": "Bearer t"}).json()
        chat = {"model": "any", "messages": [{"role": "user", "content": "hi"}]}
        thread, result = _in_thread(
            lambda: httpx.post(
                made["urls"]["openai"].rstrip("/") + "/chat/completions",
                json=chat,
                headers={"authorization": f"Bearer {made['key']}"},
                timeout=120,
            )
        )
        assert engine.called.wait(60), proxy.log_path.read_text()
        elapsed = proxy.sigterm_and_time_exit()
        assert GRACE_S - 0.5 <= elapsed <= GRACE_S + EXIT_SLACK_S, elapsed
        thread.join(10)
        reply = result[0]
        assert isinstance(reply, httpx.Response) and reply.status_code == 503, reply
        assert "shutting down" in reply.json()["error"]["message"]
    finally:
        proxy.close()
