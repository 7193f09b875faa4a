"""The engine hop's hand-written HTTP/1.1 client against real servers: uvicorn
for what an engine does, raw asyncio/socket servers (test instruments) for the
framing and failures uvicorn never produces."""

from __future__ import annotations

import asyncio
import functools
import json
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest
import uvicorn

from rollout_server.proxy.engine_client import CompletionParams, ProxyEngineClient
from rollout_server.proxy.engine_transport import EngineConnectionError, EngineTransport
from rollout_server.proxy.errors import ProxyError

from .http_instruments import (
    MALFORMED,
    ClosingServerThread,
    Handler,
    NeverAnswer,
    RawServer,
    accept_and_close,
    answer_until_eof,
    close_delimited,
    close_mid_body,
    continue_then_answer,
    continue_then_close,
    error_body,
    garbage,
    instrument_app,
    read_request,
)
from .scripted_engine import ServerThread


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with ServerThread(instrument_app()) as server:
        yield server.url


async def post_json(transport: EngineTransport, path: str, body: str = "x") -> dict[str, Any]:
    status, raw = await transport.post(path, body.encode(), timeout_s=10)
    assert status == 200, raw
    reply: dict[str, Any] = json.loads(raw)
    assert reply["body"] == body
    return reply


def test_sequential_posts_reuse_one_connection(url: str) -> None:
    async def main() -> list[int]:
        transport = EngineTransport(url)
        ports = [(await post_json(transport, "/v1/completions", f"call {i}"))["port"] for i in range(4)]
        await transport.aclose()
        return ports

    assert len(set(asyncio.run(main()))) == 1


def test_concurrent_posts_each_get_their_own_answer(url: str) -> None:
    async def main() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        transport = EngineTransport(url)
        rounds = []
        for _ in range(2):  # the second round runs on the connections the first one left idle
            rounds.append(
                await asyncio.gather(*(post_json(transport, "/v1/completions", f"call {i}" * i) for i in range(20)))
            )
        await transport.aclose()
        return rounds[0], rounds[1]

    first, second = asyncio.run(main())  # post_json checked each reply against its own request
    assert len({reply["port"] for reply in first}) == 20  # none waited for another's connection
    assert {reply["port"] for reply in second} <= {reply["port"] for reply in first}


@pytest.mark.parametrize("suffix", ["/prefix", "/prefix/"])
def test_base_url_path_prefix(url: str, suffix: str) -> None:
    async def main() -> dict[str, Any]:
        transport = EngineTransport(url + suffix)
        reply = await post_json(transport, "/v1/completions")
        await transport.aclose()
        return reply

    assert asyncio.run(main())["path"] == "/prefix/v1/completions"


def test_chunked_body_is_reassembled(url: str) -> None:
    import httpx  # only to check that the instrument really answers chunked

    body = json.dumps({"prompt": list(range(40))})
    assert httpx.post(f"{url}/stream", content=body).headers["transfer-encoding"] == "chunked"

    async def main() -> tuple[tuple[int, bytes], tuple[int, bytes]]:
        transport = EngineTransport(url)
        replies = (await transport.post("/stream", body.encode(), 10), await transport.post("/stream", b"[1]", 10))
        await transport.aclose()
        return replies

    assert asyncio.run(main()) == ((200, body.encode()), (200, b"[1]"))  # the second: after a chunked one, same conn


def test_connection_close_answer_then_a_new_connection(url: str) -> None:
    async def main() -> tuple[int, int]:
        transport = EngineTransport(url)
        closing = await post_json(transport, "/close", "first")
        following = await post_json(transport, "/v1/completions", "second")
        await transport.aclose()
        return closing["port"], following["port"]

    closed_port, next_port = asyncio.run(main())
    assert closed_port != next_port


def test_idle_connection_past_keepalive_is_not_reused(url: str) -> None:
    async def main() -> tuple[int, int, int]:
        transport = EngineTransport(url, keepalive_s=0.05)
        first = (await post_json(transport, "/v1/completions"))["port"]
        soon = (await post_json(transport, "/v1/completions"))["port"]
        await asyncio.sleep(0.1)
        late = (await post_json(transport, "/v1/completions"))["port"]
        await transport.aclose()
        return first, soon, late

    first, soon, late = asyncio.run(main())
    assert first == soon != late


def test_engine_restart_between_posts() -> None:
    """An engine restarted on the same port: uvicorn's shutdown closes the idle
    connection, the client's loop reads that close while it waits, and the
    next POST goes out on a new connection and succeeds."""

    async def serve(port: int) -> tuple[uvicorn.Server, asyncio.Task[None]]:
        server = uvicorn.Server(
            uvicorn.Config(instrument_app(), host="127.0.0.1", port=port, log_level="warning", lifespan="off")
        )
        task = asyncio.create_task(server.serve())
        while not server.started:
            await asyncio.sleep(0.005)
        return server, task

    async def main() -> tuple[int, int]:
        server, task = await serve(0)
        port = server.servers[0].sockets[0].getsockname()[1]
        transport = EngineTransport(f"http://127.0.0.1:{port}")
        before = (await post_json(transport, "/v1/completions", "before"))["port"]
        server.should_exit = True
        await task
        server, task = await serve(port)
        after = (await post_json(transport, "/v1/completions", "after"))["port"]
        await transport.aclose()
        server.should_exit = True
        await task
        return before, after

    before, after = asyncio.run(main())
    assert before != after


def test_close_unnoticed_before_the_next_post_fails_it_once() -> None:
    """The engine closed an idle connection and the client's loop has not run
    since: the close is not yet read, so the next POST goes out on that
    connection and fails with EngineConnectionError (a POST is never retried:
    it may have reached the engine). The broken connection is dropped, so the
    POST after it succeeds on a new one. keepalive_s below the engine's own
    keep-alive is what keeps this race out of normal operation."""
    server = ClosingServerThread()

    async def main() -> tuple[tuple[int, bytes], tuple[int, bytes]]:
        transport = EngineTransport(server.url)
        first = await transport.post("/v1/completions", b"x", 10)
        server.closed.wait(5)  # blocks the loop: the close is in the socket, unread
        with pytest.raises(EngineConnectionError, match="closed the connection"):
            await transport.post("/v1/completions", b"x", 10)
        last = await transport.post("/v1/completions", b"x", 10)
        await transport.aclose()
        return first, last

    try:
        assert asyncio.run(main()) == ((200, b"x"), (200, b"x"))
    finally:
        server.sock.close()


def test_connection_refused_names_host_and_port() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound, never listening, then closed: nothing answers there

    with pytest.raises(EngineConnectionError, match=f"127.0.0.1:{port}"):
        asyncio.run(EngineTransport(f"http://127.0.0.1:{port}").post("/v1/completions", b"{}", 10))


@pytest.mark.parametrize(
    ("broken", "message"),
    [
        (garbage, "malformed HTTP response"),
        (accept_and_close, "closed the connection mid-response"),
        (close_mid_body, "closed the connection mid-response"),
        (continue_then_close, "closed the connection mid-response"),
    ],
)
def test_broken_response_fails_and_the_pool_recovers(broken: Handler, message: str) -> None:
    server = RawServer(broken, answer_until_eof)

    async def main() -> tuple[int, bytes]:
        async with server.running() as raw_url:
            transport = EngineTransport(raw_url)
            with pytest.raises(EngineConnectionError, match=message):
                await asyncio.wait_for(transport.post("/v1/completions", b"doomed", 10), 5)
            reply = await transport.post("/v1/completions", b"fine", 10)
            await asyncio.wait_for(server.eof[0].wait(), 5)  # the broken connection is closed
            await transport.aclose()
            return reply

    assert asyncio.run(main()) == (200, b"fine")
    assert len(server.eof) == 2  # the second post could not have used the broken connection


# `Transfer-Encoding: identity` frames nothing: the close still ends the body.
@pytest.mark.parametrize("headers", [b"", b"Transfer-Encoding: identity\r\n"])
def test_close_delimited_body(headers: bytes) -> None:
    server = RawServer(functools.partial(close_delimited, headers=headers))
    body = json.dumps({"choices": [{"text": "a longer answer, in several segments"}]}).encode()

    async def main() -> list[tuple[int, bytes]]:
        async with server.running() as raw_url:
            transport = EngineTransport(raw_url)
            replies = [await transport.post("/v1/completions", body, 10) for _ in range(2)]
            await transport.aclose()
            return replies

    assert asyncio.run(main()) == [(200, body)] * 2
    assert len(server.eof) == 2  # a close-delimited answer leaves nothing to reuse


def test_interim_100_continue_then_the_real_response() -> None:
    server = RawServer(continue_then_answer)

    async def main() -> list[tuple[int, bytes]]:
        async with server.running() as raw_url:
            transport = EngineTransport(raw_url)
            replies = [await transport.post("/v1/completions", f"call {i}".encode(), 10) for i in range(2)]
            await transport.aclose()
            return replies

    assert asyncio.run(main()) == [(201, b"call 0"), (201, b"call 1")]
    assert len(server.eof) == 1  # kept alive across the interim responses


def test_timeout_raises_and_drops_the_connection() -> None:
    server = RawServer(NeverAnswer(), answer_until_eof)

    async def main() -> tuple[float, tuple[int, bytes]]:
        async with server.running() as raw_url:
            transport = EngineTransport(raw_url)
            start = time.monotonic()
            with pytest.raises(TimeoutError):
                await transport.post("/v1/completions", b"slow", 0.2)
            elapsed = time.monotonic() - start
            await asyncio.wait_for(server.eof[0].wait(), 5)  # the client closed the timed-out connection
            reply = await transport.post("/v1/completions", b"next", 10)
            await transport.aclose()
            return elapsed, reply

    elapsed, reply = asyncio.run(main())
    assert elapsed < 10  # only guards against a hang
    assert reply == (200, b"next") and len(server.eof) == 2


def test_cancelled_post_closes_its_connection() -> None:
    never_answer = NeverAnswer()
    server = RawServer(never_answer, answer_until_eof)

    async def main() -> tuple[int, bytes]:
        async with server.running() as raw_url:
            transport = EngineTransport(raw_url)
            slow = asyncio.create_task(transport.post("/v1/completions", b"slow", 10))
            await asyncio.wait_for(never_answer.received.wait(), 5)  # cancelled mid-call: the request is at the server
            slow.cancel()
            with pytest.raises(asyncio.CancelledError):
                await slow
            await asyncio.wait_for(server.eof[0].wait(), 5)  # closed, not merely left out of the pool
            reply = await transport.post("/v1/completions", b"next", 10)
            await transport.aclose()
            return reply

    assert asyncio.run(main()) == (200, b"next")
    assert len(server.eof) == 2


def test_aclose_closes_idle_connections() -> None:
    server = RawServer(answer_until_eof)

    async def main() -> None:
        async with server.running() as raw_url:
            transport = EngineTransport(raw_url)
            await asyncio.gather(*(transport.post("/v1/completions", b"x", 10) for _ in range(3)))
            assert not any(eof.is_set() for eof in server.eof)
            await transport.aclose()
            await asyncio.wait_for(asyncio.gather(*(eof.wait() for eof in server.eof)), 5)

    asyncio.run(main())
    assert len(server.eof) == 3


@pytest.mark.parametrize(
    "base_url", ["ftp://engine:8000", "localhost:8000", "http://", "", "engine/v1", "http://user:secret@engine:8000"]
)
def test_bad_base_url_is_a_value_error(base_url: str) -> None:
    with pytest.raises(ValueError, match="engine URL must be"):
        EngineTransport(base_url)


@pytest.mark.parametrize("code", [400, 404, 422, 500, 503])
def test_error_status_bodies_come_back_unchanged(url: str, code: int) -> None:
    async def main() -> tuple[tuple[int, bytes], int, int]:
        transport = EngineTransport(url)
        before = (await post_json(transport, "/v1/completions"))["port"]
        reply = await transport.post(f"/status/{code}", b"{}", 10)
        after = (await post_json(transport, "/v1/completions"))["port"]
        await transport.aclose()
        return reply, before, after

    reply, before, after = asyncio.run(main())
    assert reply == (code, error_body(code))
    assert before == after  # an error answer is a complete response: the connection stays


@pytest.mark.parametrize("kind", sorted(MALFORMED))
def test_engine_client_malformed_200_is_engine_unavailable(url: str, kind: str) -> None:
    async def main() -> None:
        client = ProxyEngineClient(f"{url}/malformed/{kind}", "m")
        try:
            await client.complete([1, 2, 3], CompletionParams(1.0, 1.0, -1, 4, ()))
        finally:
            await client.aclose()

    with pytest.raises(ProxyError, match="malformed completion") as failed:
        asyncio.run(main())
    assert failed.value.kind == "engine_unavailable"


def test_closing_here_mid_body_is_no_close_delimited_answer() -> None:
    """aclose() while an answer with no length is arriving: the call fails;
    the close was ours, it does not end the body."""
    headers_sent = asyncio.Event()

    async def stall_after_headers(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\n\r\npartial")
        await writer.drain()
        headers_sent.set()
        await reader.read()  # until the client closes

    server = RawServer(stall_after_headers)

    async def main() -> None:
        async with server.running() as raw_url:
            transport = EngineTransport(raw_url)
            call = asyncio.create_task(transport.post("/v1/completions", b"x", 10))
            await headers_sent.wait()
            await asyncio.sleep(0.05)  # the loop reads the headers and the partial body
            await transport.aclose()
            with pytest.raises(EngineConnectionError, match="mid-response"):
                await call

    asyncio.run(main())
