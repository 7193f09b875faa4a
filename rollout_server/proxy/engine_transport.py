"""The proxy's engine hop on the wire: keep-alive HTTP/1.1 POSTs to one engine.

Every model call crosses this hop, so its CPU is latency the proxy adds
(it must stay in the noise of a model call). A general
client pays for features this hop never uses (redirects, cookies, proxies,
decompression, multipart, per-request URL and header objects), which was
most of aiohttp's client's CPU per request (scripts/bench_proxy.py; figures
in docs/benchmarks.md). The HTTP parsing is httptools' (llhttp, the parser
uvicorn serves with): responses framed by Content-Length, chunked, or by the
connection closing; only the request line and three headers are written here.

Connections are kept per event loop (a pool is bound to the loop that made
it) and dropped after `keepalive_s` idle, before the engines' own keep-alive
(5 s for uvicorn and vLLM) closes them: a POST is not retried, so reusing a
connection the server is closing would fail the call. A connection is reused
only after a complete response the server agreed to keep alive; one left
mid-response (a timeout, a cancelled call) is closed.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from urllib.parse import urlsplit

import httptools


class EngineConnectionError(ConnectionError):
    """The engine could not be reached, or broke off or garbled a response."""


class _Connection(asyncio.Protocol):
    """One TCP connection, one request at a time."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since = 0.0
        self._waiter: asyncio.Future[tuple[int, bytes]] | None = None
        self._parser = httptools.HttpResponseParser(self)
        self._body: list[bytes] = []
        self._headers_done = False
        self._framed = False  # Content-Length or chunked: the parser knows where the body ends
        self._closed_here = False  # by us: a connection we end mid-body has not delimited it
        self.reusable = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def send(self, request: bytes, waiter: asyncio.Future[tuple[int, bytes]]) -> None:
        self._waiter, self._body, self._headers_done, self._framed, self.reusable = waiter, [], False, False, False
        self._parser = httptools.HttpResponseParser(self)
        assert self.transport is not None
        self.transport.write(request)

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:  # an engine never upgrades
            self._fail(EngineConnectionError(f"malformed HTTP response from the engine: {exc}"))
            self.close()

    # httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        if name == b"content-length" or (name == b"transfer-encoding" and b"chunked" in value.lower()):
            self._framed = True

    def on_headers_complete(self) -> None:
        self._headers_done = True

    def on_body(self, chunk: bytes) -> None:
        self._body.append(chunk)

    def on_message_complete(self) -> None:
        status = self._parser.get_status_code()
        if 100 <= status < 200:  # an interim response: the real one follows
            # Its headers are not the real response's: a close now is mid-response, not a close-delimited body.
            self._body, self._headers_done, self._framed = [], False, False
            return
        self.reusable = self._parser.should_keep_alive()
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result((status, b"".join(self._body)))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._headers_done and not self._framed and exc is None and not self._closed_here:
            self.on_message_complete()  # a body delimited by the connection closing
            self.reusable = False
        else:
            self._fail(EngineConnectionError(f"the engine closed the connection mid-response ({exc!r})"))

    def _fail(self, exc: Exception) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_exception(exc)

    def open(self) -> bool:
        # An engine's close reaches the transport before `connection_lost` runs.
        return not self.closed and self.transport is not None and not self.transport.is_closing()

    def close(self) -> None:
        self.closed = self._closed_here = True
        if self.transport is not None:
            self.transport.close()


class EngineTransport:
    """POSTs JSON bodies to one engine base URL (http or https) over a pool
    of keep-alive connections, any number at once."""

    def __init__(self, base_url: str, *, keepalive_s: float = 2.0) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname or "@" in parts.netloc:
            raise ValueError(f"engine URL must be http(s)://host[:port][/path], without credentials; got {base_url!r}")
        self.host = parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.prefix = parts.path.rstrip("/")
        self.keepalive_s = keepalive_s
        self._ssl = ssl.create_default_context() if parts.scheme == "https" else None
        self._head = f"Host: {parts.netloc}\r\nContent-Type: application/json\r\n".encode()
        self._idle: list[_Connection] = []
        self._busy: set[_Connection] = set()
        self._loop: asyncio.AbstractEventLoop | None = None

    def _checkout(self, loop: asyncio.AbstractEventLoop) -> _Connection | None:
        if self._loop is not loop:  # connections belong to the loop that opened them
            self._idle, self._busy, self._loop = [], set(), loop
        now = time.monotonic()
        while self._idle:
            conn = self._idle.pop()  # the most recently used: the least likely to be expiring
            if conn.open() and now - conn.idle_since < self.keepalive_s:
                return conn
            conn.close()
        return None

    async def _connect(self, loop: asyncio.AbstractEventLoop) -> _Connection:
        try:
            _, conn = await loop.create_connection(
                _Connection,
                self.host,
                self.port,
                ssl=self._ssl,
                server_hostname=self.host if self._ssl is not None else None,
            )
        except OSError as exc:
            raise EngineConnectionError(f"cannot connect to the engine at {self.host}:{self.port}: {exc}") from exc
        return conn

    async def post(self, path: str, body: bytes, timeout_s: float) -> tuple[int, bytes]:
        """(status, body) of `POST path`; EngineConnectionError or
        TimeoutError when no complete response came back."""
        loop = asyncio.get_running_loop()
        request = (
            b"POST "
            + (self.prefix + path).encode()
            + b" HTTP/1.1\r\n"
            + self._head
            + b"Content-Length: "
            + str(len(body)).encode()
            + b"\r\n\r\n"
            + body
        )
        conn: _Connection | None = None
        try:
            async with asyncio.timeout(timeout_s):
                conn = self._checkout(loop) or await self._connect(loop)
                self._busy.add(conn)
                waiter: asyncio.Future[tuple[int, bytes]] = loop.create_future()
                conn.send(request, waiter)
                result = await waiter
        except BaseException:
            if conn is not None:  # mid-request: what the engine still sends would be read as the next response
                conn.close()
            raise
        finally:
            if conn is not None:
                self._busy.discard(conn)
        if conn.reusable and conn.open():
            conn.idle_since = time.monotonic()
            self._idle.append(conn)
        else:
            conn.close()
        return result

    async def aclose(self) -> None:
        for conn in [*self._idle, *self._busy]:
            conn.close()
        self._idle, self._busy = [], set()
