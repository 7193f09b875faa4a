"""TEST INSTRUMENTS for the engine hop's HTTP client
(tests/proxy/test_engine_transport.py): a uvicorn app answering as the
test's path asks, for what an engine does; raw asyncio and socket servers
for the framing and failures uvicorn never produces."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


# ---- TEST INSTRUMENT: a uvicorn app answering as the test's path asks ----


async def _echo(request: Request) -> JSONResponse:
    """The body, the path and the client port: distinct ports are distinct connections."""
    assert request.client is not None
    return JSONResponse(
        {"path": request.url.path, "port": request.client.port, "body": (await request.body()).decode()}
    )


async def _stream(request: Request) -> StreamingResponse:
    body = await request.body()

    async def parts() -> AsyncIterator[bytes]:  # one http.response.body message each: uvicorn sends chunks
        for start in range(0, len(body), 7):
            yield body[start : start + 7]
            await asyncio.sleep(0)

    return StreamingResponse(parts(), media_type="application/json")


async def _close(request: Request) -> JSONResponse:
    response = await _echo(request)
    response.headers["connection"] = "close"
    return response


def error_body(code: int) -> bytes:
    return json.dumps({"error": {"message": f"failed with {code}", "code": code}}).encode()


async def _status(request: Request) -> Response:
    code = request.path_params["code"]
    return Response(error_body(code), status_code=code, media_type="application/json")


MALFORMED = {"html": b"<html>bad gateway</html>", "no-choices": b'{"object": "text_completion"}'}


async def _malformed(request: Request) -> Response:
    return Response(MALFORMED[request.path_params["kind"]], media_type="application/json")


def instrument_app() -> Starlette:
    return Starlette(
        routes=[
            Route("/stream", _stream, methods=["POST"]),
            Route("/close", _close, methods=["POST"]),
            Route("/status/{code:int}", _status, methods=["POST"]),
            Route("/malformed/{kind}/v1/completions", _malformed, methods=["POST"]),
            Route("/{path:path}", _echo, methods=["POST"]),
        ]
    )


# ---- TEST INSTRUMENT: raw asyncio servers, for what uvicorn never sends ----


async def read_request(reader: asyncio.StreamReader) -> bytes | None:
    """The body of the next request on a connection; None once the client closed it."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
    lengths = [line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")]
    return await reader.readexactly(int(lengths[0]) if lengths else 0)


def framed(body: bytes, status: str = "200 OK") -> bytes:
    return f"HTTP/1.1 {status}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body


async def answer_until_eof(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """A well-behaved keep-alive server: echoes each request body."""
    while (body := await read_request(reader)) is not None:
        writer.write(framed(body))
    writer.close()


class RawServer:
    """Connection n (from 0) is served by handlers[n], later ones by the last
    handler; `eof[n]` is set once connection n is over."""

    def __init__(self, *handlers: Handler) -> None:
        self.handlers = handlers
        self.eof: list[asyncio.Event] = []
        self._open: dict[asyncio.StreamWriter, asyncio.Task[Any]] = {}

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        index = len(self.eof)
        self.eof.append(asyncio.Event())
        self._open[writer] = asyncio.current_task()  # type: ignore[assignment]
        try:
            await self.handlers[min(index, len(self.handlers) - 1)](reader, writer)
        finally:
            writer.close()
            self.eof[index].set()

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[str]:
        server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        try:
            yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        finally:
            server.close()  # before 3.12 this leaves accepted connections open: closing them ends their handlers
            for writer in self._open:
                writer.close()
            await asyncio.gather(*self._open.values())


async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await read_request(reader)
    writer.write(b"SSH-2.0-OpenSSH_9.6\r\n\r\n")  # not HTTP; left open, so only the parser can object
    await reader.read()


async def accept_and_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await read_request(reader)
    writer.close()


async def close_mid_body(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await read_request(reader)
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n" + b'{"partial": ')
    await writer.drain()
    writer.close()


class NeverAnswer:
    """Reads the request, then waits for the client to give up and close."""

    def __init__(self) -> None:
        self.received = asyncio.Event()

    async def __call__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        self.received.set()
        await reader.read()


async def close_delimited(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, headers: bytes = b"") -> None:
    body = await read_request(reader)
    assert body is not None
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n" + headers + b"\r\n")
    for start in range(0, len(body), 5):  # several segments: the end is the close, not a write
        writer.write(body[start : start + 5])
        await writer.drain()
    writer.close()


async def continue_then_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while (body := await read_request(reader)) is not None:
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        await writer.drain()
        writer.write(framed(body, "201 Created"))
    writer.close()


async def continue_then_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await read_request(reader)
    writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
    await writer.drain()
    writer.close()


class ClosingServerThread:
    """TEST INSTRUMENT: answers each connection's first request keep-alive
    style (no `connection: close`), then closes it; `closed` is set after each
    close. A thread, so the test's loop can be kept from noticing the close."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.closed = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        with contextlib.suppress(OSError):  # the listening socket closed: the test is over
            while True:
                conn, _ = self.sock.accept()
                with conn:
                    request = b""
                    while not request.endswith(b"\r\n\r\nx"):  # every body is "x"
                        if not (chunk := conn.recv(65536)):
                            break
                        request += chunk
                    else:
                        conn.sendall(framed(b"x"))
                self.closed.set()
