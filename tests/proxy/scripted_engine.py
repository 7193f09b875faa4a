"""TEST INSTRUMENT: a scripted inference engine serving the engine surface
(vLLM subset) the proxy calls. It answers `/v1/completions` with completions
the test chose: the chosen text encoded by the real tokenizer, the turn-end
token appended, and deterministic fake logprobs, so tests can assert that
what the proxy captured is exactly what this engine emitted. It records every
prompt it receives. Not a model and not product code.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route


def fake_logprob(position: int, token_id: int) -> float:
    """Deterministic, distinct per position and id, always < 0."""
    return -0.001 * (1 + position) - 0.0001 * (token_id % 97)


def fake_prompt_logprob(position: int, token_id: int) -> float:
    """What the engine 'recomputes' for prompt token `position`: unlike any sampled logprob."""
    return -1.0 - 0.001 * position - 0.0001 * (token_id % 97)


@dataclass
class Scripted:
    text: str
    finish: str = "stop"  # "length": no turn-end token, as when max_tokens cuts a completion


@dataclass
class EngineLog:
    prompts: list[list[int]] = field(default_factory=list)
    bodies: list[dict[str, Any]] = field(default_factory=list)
    replies: list[dict[str, Any]] = field(default_factory=list)


class ScriptedEngine:
    """Replies pop from `script`; with it empty, `default` answers every call."""

    def __init__(
        self, tokenizer: Any, default: str = "ok", *, end_token: str = "<|im_end|>", max_model_len: int | None = 4096
    ) -> None:
        self.tokenizer = tokenizer
        self.end_id = tokenizer.convert_tokens_to_ids(end_token)
        self.max_model_len = max_model_len
        self.script: deque[Scripted] = deque()
        self.default = Scripted(default)
        self.log = EngineLog()
        self.down = False  # answer 500, as an engine that is failing
        self.token_id_strings = False  # omit token_ids; ids only as "token_id:<n>" logprob tokens
        self.drop_logprob = False  # one logprob short: a reply that breaks the completions contract
        self.drop_prompt_logprob = False  # one prompt logprob short, likewise
        self.delay_s = 0.0
        # Given the decoded prompt, a reply that bypasses the script (None: use the script),
        # for side calls whose timing the test does not control.
        self.respond: Callable[[str], str | None] | None = None
        # What `/v1/chat/completions` answers (for pass-through proxies that
        # call the chat route, such as LiteLLM): this message, every time.
        self.chat_message: dict[str, Any] = {"role": "assistant", "content": default}
        self._lock = threading.Lock()
        self.app = Starlette(
            routes=[
                Route("/v1/completions", self._completions, methods=["POST"]),
                Route("/v1/chat/completions", self._chat, methods=["POST"]),
                Route("/health", self._health, methods=["GET"]),
                Route("/v1/models", self._models, methods=["GET"]),
                Route("/tokenize", self._tokenize, methods=["POST"]),
            ]
        )

    def push(self, *items: str | Scripted) -> None:
        self.script.extend(Scripted(i) if isinstance(i, str) else i for i in items)

    def reset(self) -> None:
        self.script.clear()
        self.log = EngineLog()
        self.down = False
        self.token_id_strings = False
        self.drop_logprob = False
        self.drop_prompt_logprob = False
        self.delay_s = 0.0
        self.respond = None
        self.chat_message = {"role": "assistant", "content": self.default.text}

    def completion_ids(self, item: Scripted, max_tokens: int) -> list[int]:
        ids = self.tokenizer.encode(item.text, add_special_tokens=False)
        return (ids + [self.end_id] if item.finish == "stop" else ids)[:max_tokens]

    async def _completions(self, request: Request) -> Response:
        body = await request.json()
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if self.down:
            return JSONResponse({"error": "scripted failure"}, status_code=500)
        override = self.respond(self.tokenizer.decode(body["prompt"])) if self.respond else None
        with self._lock:
            if override is not None:
                item = Scripted(override)
            else:
                item = self.script.popleft() if self.script else self.default
        ids = self.completion_ids(item, int(body["max_tokens"]))
        finish = "stop" if ids and ids[-1] == self.end_id else "length"
        logprobs = [fake_logprob(i, t) for i, t in enumerate(ids)]
        choice: dict[str, Any] = {
            "index": 0,
            "text": self.tokenizer.decode(ids),
            "finish_reason": finish,
            "logprobs": {
                "tokens": [f"token_id:{t}" for t in ids],
                "token_logprobs": logprobs[1:] if self.drop_logprob else logprobs,
                "top_logprobs": None,
                "text_offset": None,
            },
        }
        if not self.token_id_strings:
            choice["token_ids"] = ids
        if body.get("prompt_logprobs") is not None:  # vLLM's shape: None first, then {id: {logprob, ...}}
            prompt = body["prompt"]
            choice["prompt_token_ids"] = prompt
            entries = [
                {str(t): {"logprob": fake_prompt_logprob(i, t), "rank": 1, "decoded_token": ""}}
                for i, t in enumerate(prompt)
                if i > 0
            ]
            choice["prompt_logprobs"] = [None, *entries][: len(prompt) - self.drop_prompt_logprob]
        reply = {
            "id": "cmpl-scripted",
            "object": "text_completion",
            "created": int(time.time()),
            "model": body.get("model"),
            "choices": [choice],
            "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": len(ids)},
        }
        self.log.prompts.append(list(body["prompt"]))
        self.log.bodies.append(body)
        self.log.replies.append({"token_ids": ids, "logprobs": logprobs})
        return JSONResponse(reply)

    async def _chat(self, request: Request) -> Response:
        body = await request.json()
        message = self.chat_message
        return JSONResponse(
            {
                "id": "chatcmpl-scripted",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": body.get("model"),
                "choices": [
                    {
                        "index": 0,
                        "message": message,
                        "logprobs": None,
                        "finish_reason": "tool_calls" if message.get("tool_calls") else "stop",
                    }
                ],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
            }
        )

    async def _health(self, request: Request) -> Response:
        return Response(status_code=500 if self.down else 200)

    async def _models(self, request: Request) -> Response:
        return JSONResponse(
            {"object": "list", "data": [{"id": "scripted", "object": "model", "max_model_len": self.max_model_len}]}
        )

    async def _tokenize(self, request: Request) -> Response:
        body = await request.json()
        return JSONResponse({"tokens": self.tokenizer.encode(body.get("prompt", ""), add_special_tokens=False)})


class ServerThread:
    """An ASGI app under uvicorn in a daemon thread, on a free local port (or on `port`)."""

    def __init__(self, app: Any, port: int = 0) -> None:
        config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("server thread did not start")
            time.sleep(0.01)
        return self

    @property
    def url(self) -> str:
        sock = self.server.servers[0].sockets[0]
        host, port = sock.getsockname()[:2]
        return f"http://{host}:{port}"

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
