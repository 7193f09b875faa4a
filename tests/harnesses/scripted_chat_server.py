"""Test instrument: an OpenAI chat-completions server that answers from a script.

It stands in for the token-capture proxy's chat route: the same URL layout
(`/s/<key>/v1/chat/completions`), the key checked both in the path and as the
bearer token, errors in OpenAI's error shape, and SSE streaming in the chunk
format clients accept. Each request pops the next scripted `Reply` and is
recorded, so tests can assert what the harness sent.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse


@dataclass
class Reply:
    content: str = ""
    tool_calls: list[tuple[str, str]] = field(default_factory=list)  # (name, raw arguments text)
    status: int = 200
    error: dict[str, Any] | None = None  # the OpenAI `error` object for a non-200 reply


def call(name: str, **arguments: Any) -> tuple[str, str]:
    return name, json.dumps(arguments)


def _error(status: int, message: str, **extra: Any) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "test_error", **extra}}, status_code=status)


class ScriptedChatServer:
    def __init__(self, key: str = "session-key-1") -> None:
        self.key = key
        self.script: list[Reply] = []
        self.requests: list[dict[str, Any]] = []
        self._ids = 0
        self._lock = threading.Lock()
        self.app = FastAPI()
        self.app.post("/s/{key}/v1/chat/completions")(self._chat)
        self.base_url = ""  # set by whoever serves `app` (the `chat_server` fixture)

    @property
    def session_url(self) -> str:
        assert self.base_url, "server not started"
        return f"{self.base_url}/s/{self.key}"

    def load(self, replies: list[Reply]) -> None:
        with self._lock:
            self.script = list(replies)
            self.requests = []

    async def _chat(self, key: str, request: Request) -> Response:
        body = await request.json()
        with self._lock:
            self.requests.append(body)
            if key != self.key or request.headers.get("authorization") != f"Bearer {self.key}":
                return _error(401, "unknown session key", code="invalid_api_key")
            if not self.script:
                return _error(500, "script exhausted")
            reply = self.script.pop(0)
            self._ids += 1
            call_ids = [f"call_{self._ids}_{i}" for i in range(len(reply.tool_calls))]
        if reply.status != 200:
            return JSONResponse({"error": reply.error or {"message": "scripted failure"}}, status_code=reply.status)
        if body.get("stream"):
            return StreamingResponse(self._sse(body, reply, call_ids), media_type="text/event-stream")
        return JSONResponse(self._completion(body, reply, call_ids))

    @staticmethod
    def _completion(body: dict[str, Any], reply: Reply, call_ids: list[str]) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": reply.content or None}
        if reply.tool_calls:
            message["tool_calls"] = [
                {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}
                for cid, (name, args) in zip(call_ids, reply.tool_calls, strict=True)
            ]
        return {
            "id": "chatcmpl-scripted",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.get("model", ""),
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "finish_reason": "tool_calls" if reply.tool_calls else "stop",
                }
            ],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        }

    @staticmethod
    def _sse(body: dict[str, Any], reply: Reply, call_ids: list[str]) -> Iterator[str]:
        def chunk(delta: dict[str, Any], finish: str | None = None) -> str:
            payload = {
                "id": "chatcmpl-scripted",
                "object": "chat.completion.chunk",
                "created": int(time.time()),
                "model": body.get("model", ""),
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
            }
            return f"data: {json.dumps(payload)}\n\n"

        yield chunk({"role": "assistant", "content": ""})
        # Split text and arguments across chunks so the client has to accumulate them.
        half = len(reply.content) // 2
        for piece in (reply.content[:half], reply.content[half:]):
            if piece:
                yield chunk({"content": piece})
        for index, (cid, (name, args)) in enumerate(zip(call_ids, reply.tool_calls, strict=True)):
            start = {"index": index, "id": cid, "type": "function", "function": {"name": name, "arguments": ""}}
            yield chunk({"tool_calls": [start]})
            cut = len(args) // 2
            for piece in (args[:cut], args[cut:]):
                yield chunk({"tool_calls": [{"index": index, "function": {"arguments": piece}}]})
        yield chunk({}, "tool_calls" if reply.tool_calls else "stop")
        yield "data: [DONE]\n\n"
