"""TEST INSTRUMENT: makes a weight update land after an exact token of a
completion, by pausing the embedded engine from the request's own sink (the
engine loop's thread), where `Engine.pause` returns at once and no further
step starts until `resume`."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

from legorl_jax.serve.request_types import Event, GenRequest, TokenEvent


@contextlib.contextmanager
def frozen_after(engine: Any, n: int) -> Iterator[threading.Event]:
    """The next request submitted to `engine` pauses it (keep) right after its n-th
    token; the event is set then. Any pause is lifted on exit."""
    frozen = threading.Event()
    submit = engine.submit

    def pausing_submit(request: GenRequest) -> None:
        engine.submit = submit
        sink, seen = request.sink, [0]

        def counting_sink(event: Event) -> None:
            sink(event)
            if isinstance(event, TokenEvent):
                seen[0] += 1
                if seen[0] == n:
                    engine.pause("keep")
                    frozen.set()

        submit(GenRequest(request.request_id, request.prompt, request.params, counting_sink))

    engine.submit = pausing_submit
    try:
        yield frozen
    finally:
        engine.submit = submit
        engine.resume()
