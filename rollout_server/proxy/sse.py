"""Server-sent events: frames, and a stream that sends keep-alive comments
while the engine works (clients drop idle streams after ~60 s) and turns a
late failure into the dialect's in-stream error event."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any, TypeVar

KEEPALIVE = b": keep-alive\n\n"
DONE = b"data: [DONE]\n\n"

T = TypeVar("T")


def frame(data: Any, event: str | None = None) -> bytes:
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n".encode()


async def with_keepalive(
    task: asyncio.Future[T],
    keepalive_s: float,
    events: Callable[[T], Iterable[bytes]],
    on_error: Callable[[BaseException], bytes],
) -> AsyncIterator[bytes]:
    """Comments every `keepalive_s` until `task` ends, then its events. The
    task is never cancelled here: a harness hanging up must not stop capture."""
    while True:
        done, _ = await asyncio.wait({task}, timeout=keepalive_s)
        if done:
            break
        yield KEEPALIVE
    try:
        result = task.result()
    except Exception as exc:  # the error goes to the client in its dialect's shape
        yield on_error(exc)
        return
    for chunk in events(result):
        yield chunk
