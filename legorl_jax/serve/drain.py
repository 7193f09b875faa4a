"""ASGI apps under uvicorn with a bounded drain, for `legorl serve`, `legorl
proxy` and servers on background threads.

On SIGTERM (or `should_exit`) uvicorn stops accepting connections and waits for
in-flight requests. Here that wait lasts `grace_s` seconds; then every request
still running is cancelled and its client gets an error it can read (a 503 with
an OpenAI-style body, or a last `error` event when an event stream has begun),
so the server stops even when a request would run for hours.
"""

from __future__ import annotations

import asyncio
import json
import math
import socket
import threading
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import uvicorn

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

# Requests aborted at the end of the grace get this long to write their error
# before uvicorn cancels them outright (an app that ignores cancellation).
ABORT_MARGIN_S = 5.0


class _Response:
    """Forwards an app's response messages and remembers how far it got, so an
    abort can end the response in a way its client reads as an error."""

    def __init__(self, send: Send) -> None:
        self._send = send
        self.started = False
        self.complete = False
        self.event_stream = False

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.started = True
            content_type = dict(message.get("headers") or []).get(b"content-type", b"")
            self.event_stream = content_type.startswith(b"text/event-stream")
        elif message["type"] == "http.response.body" and not message.get("more_body", False):
            self.complete = True
        await self._send(message)

    async def fail(self, text: str) -> None:
        error = {"message": text, "type": "ServiceUnavailableError", "param": None, "code": 503}
        if not self.started:
            body = json.dumps({"error": error}).encode()
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
            await self._send({"type": "http.response.start", "status": 503, "headers": headers})
            await self._send({"type": "http.response.body", "body": body})
        elif self.event_stream:
            # An `error` event whose data holds an `error` object: the OpenAI and
            # Anthropic SDKs both raise on it.
            data = json.dumps({"type": "error", "error": error})
            await self._send({"type": "http.response.body", "body": f"event: error\ndata: {data}\n\n".encode()})
        else:
            # Half a plain body cannot be turned into an error; uvicorn closes the connection.
            raise RuntimeError(text)


class AbortGate:
    """ASGI middleware that can end every in-flight HTTP request with an error.
    Each request runs in a task of its own, so `abort` can cancel it while the
    gate, still in uvicorn's task, writes the error."""

    def __init__(self, app: ASGIApp, message: str) -> None:
        self.app = app
        self.message = message
        self._running: set[asyncio.Future[None]] = set()
        self._aborting = False

    def abort(self) -> None:
        self._aborting = True
        for task in self._running:
            task.cancel()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        response = _Response(send)
        task = asyncio.ensure_future(self.app(scope, receive, response.send))
        self._running.add(task)
        try:
            await asyncio.wait({task})
        except asyncio.CancelledError:
            task.cancel()  # uvicorn gave up on the request itself
            raise
        finally:
            self._running.discard(task)
        if self._aborting and not response.complete:
            if not task.cancelled():
                task.exception()  # retrieved: the abort's error replaces it
            await response.fail(self.message)
        else:
            task.result()  # the app's own exception goes to uvicorn as before


class DrainingServer(uvicorn.Server):
    """uvicorn whose shutdown waits `grace_s` seconds for in-flight requests,
    then aborts them through the app's `AbortGate`."""

    def __init__(self, config: uvicorn.Config, gate: AbortGate, grace_s: float) -> None:
        super().__init__(config)
        self.gate = gate
        self.grace_s = grace_s

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        timer = asyncio.get_running_loop().call_later(self.grace_s, self.gate.abort)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()


def draining_server(app: ASGIApp, *, grace_s: float, **options: Any) -> DrainingServer:
    """A `DrainingServer` for `app`; `options` are uvicorn.Config's (host, port, log_level, …)."""
    gate = AbortGate(app, f"server shutting down: request aborted after the {grace_s:g} s drain")
    # uvicorn's own limit is the backstop for a request that ignores the abort.
    config = uvicorn.Config(gate, timeout_graceful_shutdown=math.ceil(grace_s + ABORT_MARGIN_S), **options)
    return DrainingServer(config, gate, grace_s)


def serve(app: ASGIApp, *, grace_s: float, **options: Any) -> None:
    """Runs `app` in the foreground until SIGTERM or SIGINT, then drains for at most `grace_s`."""
    draining_server(app, grace_s=grace_s, **options).run()


class BackgroundServer:
    """A draining uvicorn on a thread; port 0 picks a free port, read back from `url`."""

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0, grace_s: float = 5.0) -> None:
        self._server = draining_server(app, grace_s=grace_s, host=host, port=port, log_level="warning", lifespan="off")
        self._thread = threading.Thread(target=self._server.run, name="legorl-uvicorn", daemon=True)
        self.host = host
        self.url = ""

    def start(self, timeout: float = 60.0) -> BackgroundServer:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        port = self._server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://{self.host}:{port}"
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=self._server.grace_s + 2 * ABORT_MARGIN_S)
