"""Asyncio helpers both sides use."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import TypeVar

T = TypeVar("T")


@contextlib.asynccontextmanager
async def completion_order(tasks: Sequence[asyncio.Task[T]]) -> AsyncIterator[Iterator[asyncio.Future[T]]]:
    """`asyncio.as_completed(tasks)`, with every task still running cancelled and
    awaited on exit: a caller that stops early (an error, a cancelled call, a
    closed stream) leaves no task behind, and each gets to run its own cleanup."""
    try:
        yield asyncio.as_completed(tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
