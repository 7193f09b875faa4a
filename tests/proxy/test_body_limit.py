"""Request bodies past `proxy.max_request_bytes` get a 413 naming the setting,
whether their length is declared (refused unread) or chunked (refused at the
byte past the cap), on model calls, token counts and the admin API alike."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from urllib.parse import urlsplit

import httpx
import pytest

from rollout_server.proxy.app import build_app
from rollout_server.proxy.engine_client import ProxyEngineClient
from rollout_server.proxy.render import ChatTemplate
from rollout_server.proxy.service import ProxyCore
from rollout_server.proxy.session import SessionStore

from .conftest import ADMIN_TOKEN, MAX_CONTEXT
from .scripted_engine import ScriptedEngine, ServerThread

LIMIT = 64 * 1024
ADMIN = {"authorization": f"Bearer {ADMIN_TOKEN}"}


@pytest.fixture()
def small(engine: ScriptedEngine, template: ChatTemplate, _engine_server: tuple[ScriptedEngine, str]) -> Iterator[str]:
    client = ProxyEngineClient(_engine_server[1], "scripted")
    core = ProxyCore(template, client, SessionStore(), max_context=MAX_CONTEXT)
    with ServerThread(build_app(core, admin_token=ADMIN_TOKEN, max_request_bytes=LIMIT)) as server:
        yield server.url


def _refused(reply: httpx.Response) -> None:
    assert reply.status_code == 413, reply.text
    assert "proxy.max_request_bytes" in reply.json()["error"]["message"] and str(LIMIT) in reply.text


def _chunked(url: str, path: str, headers: dict[str, str], size: int) -> tuple[int, bytes]:
    """POSTs `size` bytes as a chunked body over a raw socket; (status, body) of the answer."""
    parts = urlsplit(url)
    with socket.create_connection((parts.hostname, parts.port), timeout=30) as conn:
        head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        conn.sendall(f"POST {path} HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n{head}\r\n".encode())
        chunk = b"x" * 8192
        try:
            for _ in range(size // len(chunk)):
                conn.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            conn.sendall(b"0\r\n\r\n")
        except OSError:  # the proxy answered and closed before taking it all
            pass
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.endswith(b"}"):
            data = conn.recv(65536)
            if not data:
                break
            answer += data
    status = int(answer.split(b" ", 2)[1])
    return status, answer.split(b"\r\n\r\n", 1)[1]


def test_oversized_bodies_get_413_naming_the_setting(small: str, engine: ScriptedEngine) -> None:
    key = httpx.post(f"{small}/admin/sessions", json={}, headers=ADMIN).json()["key"]
    big = {"model": "m", "messages": [{"role": "user", "content": "x" * LIMIT}]}
    for path in ("/v1/chat/completions", "/v1/messages/count_tokens", "/v1beta/models/m:generateContent"):
        _refused(httpx.post(f"{small}/s/{key}{path}", json=big, timeout=30))
    _refused(httpx.post(f"{small}/admin/sessions", json={"labels": {"x": "y" * LIMIT}}, headers=ADMIN))
    status, body = _chunked(small, f"/s/{key}/v1/chat/completions", {"content-type": "application/json"}, 4 * LIMIT)
    assert status == 413 and b"proxy.max_request_bytes" in body
    # Under the cap, a body is read as before.
    fits = {"model": "m", "messages": [{"role": "user", "content": "x" * (LIMIT // 2)}]}
    reply = httpx.post(f"{small}/s/{key}/v1/messages/count_tokens", json=fits, timeout=30)
    assert reply.status_code == 200 and reply.json()["input_tokens"] > 1000, reply.text
