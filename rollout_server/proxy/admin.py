"""Admin API for standalone use: create sessions, read trajectories, delete.

`POST /admin/sessions` (Bearer admin token; body: a `SessionSpec`, plus an
optional `key`) answers `{"key", "urls"}` with each URL exactly what that
dialect's SDK or CLI takes as its base URL (OpenAI's ends in `/v1`).
These sessions expire when idle (`SessionStore`): an expired one's trajectory
is answered once, marked `"expired": true`; after that, or once it is lost,
its key gets 410 saying why.
"""

from __future__ import annotations

import hmac
import re
from collections.abc import Callable
from typing import Any

from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from rollout_server.proxy import jsonio
from rollout_server.proxy.errors import ProxyError
from rollout_server.proxy.jsonio import FastJSONResponse
from rollout_server.proxy.service import ProxyCore
from rollout_server.proxy.session import Session, SessionSpec, StoreFull

# Keys travel in URL paths and headers.
_KEY = re.compile(r"[A-Za-z0-9_-]{1,128}")


def _problem(status: int, message: str) -> FastJSONResponse:
    return FastJSONResponse({"error": {"message": message}}, status_code=status)


def session_urls(base_url: str, key: str) -> dict[str, str]:
    root = f"{base_url.rstrip('/')}/s/{key}"
    return {"anthropic": root, "openai": f"{root}/v1", "gemini": root}


def trajectory_json(session: Session) -> dict[str, Any]:
    return {
        "key": session.key,
        "labels": session.spec.labels,
        "policy_version": session.spec.policy_version,
        **session.trajectory.to_json(),
    }


def admin_routes(core: ProxyCore, admin_token: str | None) -> list[Route]:
    """No routes at all without an admin token: nothing to guess at."""
    if not admin_token:
        return []

    expected = admin_token.encode()

    def authorized(request: Request) -> bool:
        # As bytes: `compare_digest` refuses non-ASCII text, and header values arrive as Latin-1 text.
        auth = request.headers.get("authorization", "")
        return auth[:7].lower() == "bearer " and hmac.compare_digest(auth[7:].strip().encode("latin-1"), expected)

    async def create(request: Request) -> Response:
        if not authorized(request):
            return _problem(401, "admin token required (Authorization: Bearer <token>)")
        try:
            body = jsonio.loads(await request.body() or b"{}")
        except ValueError as exc:
            return _problem(400, f"request body is not valid JSON: {exc}")
        if not isinstance(body, dict):
            return _problem(400, "request body must be a JSON object")
        key = body.pop("key", None)
        if key is not None and (not isinstance(key, str) or not _KEY.fullmatch(key)):
            return _problem(400, "key: expected a non-empty string of letters, digits, '-' and '_'")
        try:
            spec = SessionSpec.model_validate(body)
        except ValidationError as exc:
            return _problem(400, f"invalid session spec: {exc}")
        if spec.recompute_logprobs:  # refused now rather than at the first call that recomputes
            try:
                core.engine.check_recompute(spec.sampling.temperature)
            except ProxyError as exc:
                return _problem(exc.status, exc.message)
        try:
            session = core.store.create(spec, key, expires=True)
        except StoreFull as exc:
            return _problem(429, str(exc))
        except ValueError as exc:
            return _problem(409, str(exc))
        return FastJSONResponse(
            {"key": session.key, "urls": session_urls(str(request.base_url), session.key)}, status_code=201
        )

    def answer_trajectory(request: Request, lookup: Callable[[str], Session | None]) -> Response:
        """The trajectory of the session `lookup` finds (reading it, or removing it) by the path's key."""
        if not authorized(request):
            return _problem(401, "admin token required (Authorization: Bearer <token>)")
        key = request.path_params["key"]
        session = lookup(key)
        if session is not None:
            return FastJSONResponse(trajectory_json(session))
        session = core.store.take_expired(key)
        if session is not None:
            return FastJSONResponse({**trajectory_json(session), "expired": True})
        gone = core.store.gone(key)
        if gone is not None:
            return _problem(410, f"session gone: {gone}; raise proxy.session_idle_timeout_s to keep sessions longer")
        return _problem(404, "no such session")

    async def trajectory(request: Request) -> Response:
        return answer_trajectory(request, core.store.get)

    async def delete(request: Request) -> Response:
        return answer_trajectory(request, core.store.delete)

    return [
        Route("/admin/sessions", create, methods=["POST"]),
        Route("/admin/sessions/{key}/trajectory", trajectory, methods=["GET"]),
        Route("/admin/sessions/{key}", delete, methods=["DELETE"]),
    ]
