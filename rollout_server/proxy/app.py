"""The proxy's ASGI app: every dialect's routes, at the root (session from
`x-api-key` / Bearer / `x-goog-api-key` / `?key=`) and under `/s/<key>/`.

A request with no live session's key gets 401 in its dialect's shape, so the
proxy is never an open relay to the engine.

Model calls (POSTs to the dialect routes) are dispatched by path before
Starlette's middleware stack and route table, whose CPU per call is a
measurable share of a hop that should add under a millisecond
(docs/benchmarks.md); they reach the same endpoints, and everything else
(other methods, admin, probes, lifespan, requests under a root path) goes
through Starlette as declared.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import BaseRoute, Mount, Route
from starlette.types import Receive, Scope, Send

from legorl_jax.core import log_redaction
from legorl_jax.core.body_limit import DEFAULT_MAX_REQUEST_BYTES, BodyLimit
from rollout_server.proxy import jsonio, sse
from rollout_server.proxy.admin import admin_routes
from rollout_server.proxy.dialects import Dialect
from rollout_server.proxy.dialects.anthropic import Anthropic
from rollout_server.proxy.dialects.gemini import Gemini
from rollout_server.proxy.dialects.openai_chat import OpenAIChat
from rollout_server.proxy.dialects.responses import Responses
from rollout_server.proxy.errors import ProxyError, invalid
from rollout_server.proxy.jsonio import FastJSONResponse
from rollout_server.proxy.parsed_items import ItemMemo
from rollout_server.proxy.service import ProxyCore
from rollout_server.proxy.session import Session
from rollout_server.proxy.turn import TurnResult

log = logging.getLogger(__name__)

_SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}
_GEMINI_PREFIXES = ("/v1beta/models/", "/v1/models/")

Endpoint = Callable[[Request], Awaitable[Response]]


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
        return jsonio.harness_loads(raw)
    except ValueError as exc:
        raise invalid(f"request body is not valid JSON: {exc}") from exc


# Nesting that parsed but is too deep for what reads it (a schema walk, a JSON
# dump): the harness's input, so a 400 rather than a proxy fault.
_TOO_DEEP = "the request nests too deeply"


class _SSEStream(StreamingResponse):
    """Server-sent events that call `on_hang_up` when the harness leaves before the last one."""

    def __init__(self, events: AsyncIterator[bytes], on_hang_up: Callable[[], None]) -> None:
        super().__init__(self._through(events), media_type="text/event-stream", headers=_SSE_HEADERS)
        self._on_hang_up = on_hang_up
        self._ended = False

    async def _through(self, events: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        async for chunk in events:
            yield chunk
        self._ended = True

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if not self._ended:
                self._on_hang_up()


class ProxyApp:
    def __init__(
        self,
        core: ProxyCore,
        *,
        keepalive_s: float = 15.0,
        admin_token: str | None = None,
        max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    ) -> None:
        log_redaction.install()  # session keys are in the URLs uvicorn and clients log
        log_redaction.add_secret(admin_token)
        self.core = core
        self.keepalive_s = keepalive_s
        self.admin_token = admin_token
        # Engine calls outlive hung-up clients; references keep them from being collected.
        self._running: set[asyncio.Task[TurnResult]] = set()
        self.openai, self.anthropic, self.responses, self.gemini = OpenAIChat(), Anthropic(), Responses(), Gemini()
        self.posts = self._posts()
        self.starlette = self._starlette()
        self._limited = BodyLimit(self._dispatch, max_request_bytes, "proxy.max_request_bytes")

    def _session(self, request: Request) -> Session:
        key = _key(request)
        session = self.core.store.get(key)
        if session is None:
            gone = self.core.store.gone(key)  # an expired session's harness is told why, not just refused
            why = f"session ended: {gone}" if gone else "no live session has this key"
            raise ProxyError("authentication", f"invalid API key: {why}")
        return session

    def _error(self, dialect: Dialect, err: ProxyError) -> Response:
        return FastJSONResponse(dialect.error(err), status_code=err.status)

    async def model_call(self, request: Request, dialect: Dialect, params: dict[str, str]) -> Response:
        try:
            session = self._session(request)
            chat = dialect.parse(await _body(request), params, session.parsed.setdefault(dialect.name, ItemMemo()))
            prepared = self.core.prepare(session, chat, dialect.name, dialect.tool_id_prefix)
        except ProxyError as err:
            return self._error(dialect, err)
        except RecursionError:
            return self._error(dialect, invalid(_TOO_DEEP))
        except Exception as exc:  # a proxy bug still answers in the harness's dialect
            return self._error(dialect, _internal(exc))
        task = asyncio.create_task(self.core.execute(prepared))
        self._running.add(task)
        task.add_done_callback(self._running.discard)

        def events(result: TurnResult) -> Iterator[bytes]:
            yield from dialect.stream(result, chat)
            self.core.finish(prepared)

        def on_error(exc: BaseException) -> bytes:
            err = exc if isinstance(exc, ProxyError) else _internal(exc)
            return dialect.stream_error(err)

        if not chat.stream:
            try:  # shielded: a cancelled handler must not cancel the engine call
                result = await asyncio.shield(task)
            except Exception as exc:
                return self._error(dialect, exc if isinstance(exc, ProxyError) else _internal(exc))
            body = dialect.response(result, chat)
            self.core.finish(prepared)
            return FastJSONResponse(body)
        # Short engine failures still come back as plain HTTP errors; only a
        # call that outlasts one keep-alive interval opens the stream early.
        done, _ = await asyncio.wait({task}, timeout=self.keepalive_s)
        failure = task.exception() if done else None
        if failure is not None:
            return self._error(dialect, failure if isinstance(failure, ProxyError) else _internal(failure))
        return _SSEStream(
            sse.with_keepalive(task, self.keepalive_s, events, on_error), lambda: self.core.hang_up(prepared)
        )

    async def count_tokens(self, request: Request, dialect: Dialect, params: dict[str, str]) -> Response:
        try:
            session = self._session(request)
            chat = dialect.parse(await _body(request), params)
            count = self.core.count_tokens(session, chat)
        except ProxyError as err:
            return self._error(dialect, err)
        except RecursionError:
            return self._error(dialect, invalid(_TOO_DEEP))
        except Exception as exc:
            return self._error(dialect, _internal(exc))
        return FastJSONResponse({"totalTokens": count} if dialect is self.gemini else {"input_tokens": count})

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
        name = self.core.model_name
        return FastJSONResponse({"object": "list", "data": [{"id": name, "object": "model", "owned_by": "legorl"}]})

    async def gemini_call(self, request: Request) -> Response:
        model, _, action = request.path_params["target"].partition(":")
        params = {"model": model, "action": action}
        if action == "countTokens":
            return await self.count_tokens(request, self.gemini, params)
        if action not in ("generateContent", "streamGenerateContent"):
            return self._error(self.gemini, ProxyError("not_found", f"unknown model action {action!r}"))
        return await self.model_call(request, self.gemini, params)

    def _posts(self) -> dict[str, Endpoint]:
        """The dialects' fixed-path POST routes, at the root and under `/s/<key>`."""

        def call(dialect: Dialect, handler: Any) -> Endpoint:
            async def endpoint(request: Request) -> Response:
                return await handler(request, dialect, {})

            return endpoint

        return {
            "/v1/messages": call(self.anthropic, self.model_call),
            "/v1/messages/count_tokens": call(self.anthropic, self.count_tokens),
            "/v1/chat/completions": call(self.openai, self.model_call),
            "/v1/responses": call(self.responses, self.model_call),
        }

    def dialect_routes(self) -> list[BaseRoute]:
        return [
            Route("/", self.probe, methods=["GET", "HEAD"]),
            *(Route(path, endpoint, methods=["POST"]) for path, endpoint in self.posts.items()),
            Route("/v1/models", self.models, methods=["GET"]),
            *(Route(prefix + "{target}", self.gemini_call, methods=["POST"]) for prefix in _GEMINI_PREFIXES),
        ]

    def match_post(self, path: str) -> tuple[Endpoint, dict[str, str]] | None:
        """The endpoint and path parameters Starlette's routes give a POST to
        `path` (`{key}` and `{target}` match one non-empty segment), when it
        is a dialect route; None otherwise."""
        params: dict[str, str] = {}
        if path.startswith("/s/"):
            key, slash, rest = path[3:].partition("/")
            if not key or not slash:
                return None
            params["key"], path = key, "/" + rest
        endpoint = self.posts.get(path)
        if endpoint is not None:
            return endpoint, params
        for prefix in _GEMINI_PREFIXES:
            target = path[len(prefix) :] if path.startswith(prefix) else ""
            if target and "/" not in target:
                return self.gemini_call, {**params, "target": target}
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The ASGI app, its request bodies capped (`BodyLimit`)."""
        await self._limited(scope, receive, send)

    async def _dispatch(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Behind a `root_path` (a mount point) Starlette strips it before
        routing: such requests take the declared routes."""
        fast = scope["type"] == "http" and scope["method"] == "POST" and not scope.get("root_path")
        found = self.match_post(scope["path"]) if fast else None
        if found is None:
            await self.starlette(scope, receive, send)
            return
        endpoint, scope["path_params"] = found
        response = await endpoint(Request(scope, receive))
        await response(scope, receive, send)

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        """Closes the engine connections this app's event loop opened."""
        yield
        close = getattr(self.core.engine, "aclose", None)  # engines stand-ins (demonstrations) hold none
        if close is not None:
            await close()

    def _starlette(self) -> Starlette:
        routes = self.dialect_routes()
        return Starlette(
            lifespan=self.lifespan,
            routes=[
                Route("/health", self.health, methods=["GET"]),
                *admin_routes(self.core, self.admin_token),
                Route("/s/{key}", self.probe, methods=["GET", "HEAD"]),
                Mount("/s/{key}", routes=routes),
                *routes,
            ],
        )

    async def health(self, request: Request) -> Response:
        return FastJSONResponse({"ok": True, "sessions": len(self.core.store)})


def _internal(exc: BaseException) -> ProxyError:
    """A fault inside the proxy: logged with its traceback, and answered as
    the engine being unavailable so harnesses retry rather than give up."""
    log.error("proxy fault", exc_info=exc)
    return ProxyError("engine_unavailable", f"proxy fault: {exc!r}")


def build_app(
    core: ProxyCore,
    *,
    keepalive_s: float = 15.0,
    admin_token: str | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
) -> ProxyApp:
    return ProxyApp(core, keepalive_s=keepalive_s, admin_token=admin_token, max_request_bytes=max_request_bytes)
