"""A cap on request bodies for every HTTP service (ASGI middleware).

A body whose Content-Length passes the cap is refused before a byte of it is
read; a chunked body, or one longer than it said, is counted as it arrives and
refused at the byte that passes the cap, so a stream of oversized requests
never holds more than the cap in memory. The refusal is a 413 naming the cap
and the setting that raises it, in a shape the harnesses' SDKs read (OpenAI's
and Anthropic's `error.message`, Gemini's `error.code`).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[MutableMapping[str, Any], Receive, Send], Awaitable[None]]

# Room for the longest harness sessions (a Claude Code call is some 100-300 KB of JSON) many times over.
DEFAULT_MAX_REQUEST_BYTES = 32 * 2**20


class _TooLarge(BaseException):
    """Raised from `receive`; a BaseException so that no handler's catch-all
    (the proxy answers its own faults in the harness's dialect) takes it for a fault."""


class BodyLimit:
    def __init__(self, app: ASGIApp, limit: int, setting: str) -> None:
        self.app, self.limit, self.setting = app, limit, setting

    async def __call__(self, scope: MutableMapping[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or ()).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await self._refuse(send)
            return
        received = 0
        started = False

        async def counted() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    raise _TooLarge
            return message

        async def watched(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted, watched)
        except _TooLarge:
            if started:  # an app that answered before reading its whole body: nothing left to refuse with
                return
            await self._refuse(send)

    async def _refuse(self, send: Send) -> None:
        message = f"request body larger than {self.limit} bytes; raise {self.setting} to accept larger requests"
        body = json.dumps(
            {
                "type": "error",
                "error": {"type": "request_too_large", "message": message, "code": 413, "status": "INVALID_ARGUMENT"},
            }
        ).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": 413, "headers": headers})
        await send({"type": "http.response.body", "body": body})
