"""The proxy's ASGI app: every dialect's routes, at the root (session from
`x-api-key` / Bearer / `x-goog-api-key` / `?key=`) and under `/s/<key>/`.

A request with no live session's key gets 401 in its dialect's shape, so the
proxy is never an open relay to the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Iterator
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import BaseRoute, Mount, Route

from rollout_server.proxy import sse
from rollout_server.proxy.admin import admin_routes
from rollout_server.proxy.dialects import Dialect
from rollout_server.proxy.dialects.anthropic import Anthropic
from rollout_server.proxy.dialects.gemini import Gemini
from rollout_server.proxy.dialects.openai_chat import OpenAIChat
from rollout_server.proxy.dialects.responses import Responses
from rollout_server.proxy.errors import ProxyError, invalid
from rollout_server.proxy.service import ProxyCore, TurnResult
from rollout_server.proxy.session import Session

log = logging.getLogger(__name__)

_SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


def _key(request: Request) -> str | None:
    if "key" in request.path_params:
        return request.path_params["key"]
    headers = request.headers
    auth = headers.get("authorization", "")
    bearer = auth[7:].strip() if auth[:7].lower() == "bearer " else None
    return headers.get("x-api-key") or bearer or headers.get("x-goog-api-key") or request.query_params.get("key")


async def _body(request: Request) -> Any:
    raw = await request.body()
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise invalid(f"request body is not valid JSON: {exc}") from exc


class ProxyApp:
    def __init__(self, core: ProxyCore, *, keepalive_s: float = 15.0, admin_token: str | None = None) -> None:
        self.core = core
        self.keepalive_s = keepalive_s
        self.admin_token = admin_token
        # Engine calls outlive hung-up clients; references keep them from being collected.
        self._running: set[asyncio.Task[TurnResult]] = set()
        self.openai, self.anthropic, self.responses, self.gemini = OpenAIChat(), Anthropic(), Responses(), Gemini()

    def _session(self, request: Request) -> Session:
        session = self.core.store.get(_key(request))
        if session is None:
            raise ProxyError("authentication", "invalid API key: no live session has this key")
        return session

    def _error(self, dialect: Dialect, err: ProxyError) -> JSONResponse:
        return JSONResponse(dialect.error(err), status_code=err.status)

    async def model_call(self, request: Request, dialect: Dialect, params: dict[str, str]) -> Response:
        try:
            session = self._session(request)
            chat = dialect.parse(await _body(request), params)
            prepared = self.core.prepare(session, chat, dialect.name, dialect.tool_id_prefix)
        except ProxyError as err:
            return self._error(dialect, err)
        except Exception as exc:  # a proxy bug still answers in the harness's dialect
            return self._error(dialect, _internal(exc))
        task = asyncio.create_task(self.core.execute(prepared))
        self._running.add(task)
        task.add_done_callback(self._running.discard)

        def events(result: TurnResult) -> Iterator[bytes]:
            yield from dialect.stream(result, chat)
            self.core.finish(prepared, result)

        def on_error(exc: BaseException) -> bytes:
            err = exc if isinstance(exc, ProxyError) else _internal(exc)
            return dialect.stream_error(err)

        # Short engine failures still come back as plain HTTP errors; only a
        # call that outlasts one keep-alive interval opens the stream early.
        done, _ = await asyncio.wait({task}, timeout=self.keepalive_s if chat.stream else None)
        if done and task.exception() is not None:
            exc = task.exception()
            return self._error(dialect, exc if isinstance(exc, ProxyError) else _internal(exc))
        if not chat.stream:
            result = task.result()
            body = dialect.response(result, chat)
            self.core.finish(prepared, result)
            return JSONResponse(body)
        return StreamingResponse(sse.with_keepalive(task, self.keepalive_s, events, on_error),
                                 media_type="text/event-stream", headers=_SSE_HEADERS)

    async def count_tokens(self, request: Request, dialect: Dialect, params: dict[str, str]) -> Response:
        try:
            session = self._session(request)
            chat = dialect.parse(await _body(request), params)
            count = self.core.count_tokens(session, chat)
        except ProxyError as err:
            return self._error(dialect, err)
        except Exception as exc:
            return self._error(dialect, _internal(exc))
        return JSONResponse({"totalTokens": count} if dialect is self.gemini else {"input_tokens": count})

    async def probe(self, request: Request) -> Response:
        """`HEAD /` (Claude Code's connectivity check) and `GET /`."""
        if "key" in request.path_params and self.core.store.get(request.path_params["key"]) is None:
            return self._error(self.anthropic, ProxyError("authentication", "invalid API key"))
        return Response(status_code=200)

    async def models(self, request: Request) -> Response:
        try:
            self._session(request)
        except ProxyError as err:
            return self._error(self.openai, err)
        name = self.core.engine.model
        return JSONResponse({"object": "list", "data": [{"id": name, "object": "model", "owned_by": "legorl"}]})

    async def gemini_call(self, request: Request) -> Response:
        model, _, action = request.path_params["target"].partition(":")
        params = {"model": model, "action": action}
        if action == "countTokens":
            return await self.count_tokens(request, self.gemini, params)
        if action not in ("generateContent", "streamGenerateContent"):
            return self._error(self.gemini, ProxyError("not_found", f"unknown model action {action!r}"))
        return await self.model_call(request, self.gemini, params)

    def dialect_routes(self) -> list[BaseRoute]:
        def call(dialect: Dialect, handler: Any) -> Any:
            async def endpoint(request: Request) -> Response:
                return await handler(request, dialect, {})
            return endpoint

        return [
            Route("/", self.probe, methods=["GET", "HEAD"]),
            Route("/v1/messages", call(self.anthropic, self.model_call), methods=["POST"]),
            Route("/v1/messages/count_tokens", call(self.anthropic, self.count_tokens), methods=["POST"]),
            Route("/v1/chat/completions", call(self.openai, self.model_call), methods=["POST"]),
            Route("/v1/responses", call(self.responses, self.model_call), methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1beta/models/{target}", self.gemini_call, methods=["POST"]),
            Route("/v1/models/{target}", self.gemini_call, methods=["POST"]),
        ]

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        """Closes the engine connections this app's event loop opened."""
        yield
        close = getattr(self.core.engine, "aclose", None)  # engines stand-ins (demonstrations) hold none
        if close is not None:
            await close()

    def build(self) -> Starlette:
        routes = self.dialect_routes()
        return Starlette(lifespan=self.lifespan, routes=[
            Route("/health", self.health, methods=["GET"]),
            *admin_routes(self.core, self.admin_token),
            Route("/s/{key}", self.probe, methods=["GET", "HEAD"]),
            Mount("/s/{key}", routes=routes),
            *routes,
        ])

    async def health(self, request: Request) -> Response:
        return JSONResponse({"ok": True, "sessions": len(self.core.store)})


def _internal(exc: BaseException) -> ProxyError:
    """A fault inside the proxy: logged with its traceback, and answered as
    the engine being unavailable so harnesses retry rather than give up."""
    log.error("proxy fault", exc_info=exc)
    return ProxyError("engine_unavailable", f"proxy fault: {exc!r}")


def build_app(core: ProxyCore, *, keepalive_s: float = 15.0, admin_token: str | None = None) -> Starlette:
    return ProxyApp(core, keepalive_s=keepalive_s, admin_token=admin_token).build()
