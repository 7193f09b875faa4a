"""`completion_order`: results as tasks finish; a caller that stops early leaves no task running."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

from legorl_jax.core.aio import completion_order


def test_results_come_in_finishing_order() -> None:
    async def after(delay: float, value: str) -> str:
        await asyncio.sleep(delay)
        return value

    async def main() -> list[str]:
        tasks = [asyncio.create_task(after(d, v)) for d, v in ((0.2, "slow"), (0.0, "fast"), (0.1, "mid"))]
        async with completion_order(tasks) as finished:
            return [await next_done for next_done in finished]

    assert asyncio.run(main()) == ["fast", "mid", "slow"]


def test_stopping_early_cancels_the_rest_and_waits_for_their_cleanup() -> None:
    cleaned: list[int] = []

    async def trial(i: int) -> int:
        try:
            await asyncio.sleep(0 if i == 0 else 60)
            return i
        finally:
            await asyncio.sleep(0.01)  # cleanup that itself awaits, like a sandbox teardown
            cleaned.append(i)

    async def main() -> tuple[int, list[bool]]:
        tasks = [asyncio.create_task(trial(i)) for i in range(3)]
        async with completion_order(tasks) as finished:
            for next_done in finished:
                first = await next_done
                break
        return first, [t.cancelled() for t in tasks]

    first, cancelled = asyncio.run(main())
    assert first == 0 and cancelled == [False, True, True]
    assert sorted(cleaned) == [0, 1, 2]


def test_a_closed_stream_cancels_the_rest() -> None:
    """The pattern the callers use: an async generator yielding inside the block, closed by its consumer."""

    async def main() -> list[bool]:
        tasks = [asyncio.create_task(asyncio.sleep(d, result=d)) for d in (0.0, 60.0)]

        async def stream() -> AsyncGenerator[float, None]:
            async with completion_order(tasks) as finished:
                for next_done in finished:
                    yield await next_done

        results = stream()
        assert await results.__anext__() == 0.0
        await results.aclose()
        return [t.done() for t in tasks]

    assert asyncio.run(main()) == [True, True]
