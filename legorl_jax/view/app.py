"""The viewer's ASGI app: a static page and a small JSON API over a run directory."""

from __future__ import annotations

from pathlib import Path

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from legorl_jax.view.data import RunReader

STATIC = Path(__file__).resolve().parent / "static"


def _int(request: Request, name: str, default: int | None) -> int | None:
    try:
        return int(request.query_params[name])
    except (KeyError, ValueError):
        return default


def _since(request: Request) -> int:
    return max(_int(request, "since", 0) or 0, 0)


def create_app(run_dir: Path) -> Starlette:
    reader = RunReader(run_dir)

    # Plain `def` handlers: Starlette runs them in its thread pool, so file reads never block the loop.
    def index(request: Request) -> FileResponse:
        return FileResponse(STATIC / "index.html")

    def run(request: Request) -> JSONResponse:
        return JSONResponse(reader.state())

    def metrics(request: Request) -> JSONResponse:
        return JSONResponse(reader.metric_records(_since(request), _int(request, "epoch", None)))

    def rollouts(request: Request) -> JSONResponse:
        return JSONResponse(reader.rollout_rows(_since(request), _int(request, "epoch", None)))

    def trajectory(request: Request) -> JSONResponse:
        index = request.path_params["index"]
        record = reader.trajectory(index)
        if record is None:
            return JSONResponse({"error": f"no trajectory #{index} in this run"}, status_code=404)
        return JSONResponse({"index": index, **record})

    return Starlette(
        routes=[
            Route("/", index),
            Route("/api/run", run),
            Route("/api/metrics", metrics),
            Route("/api/rollouts", rollouts),
            Route("/api/rollouts/{index:int}", trajectory),
            Mount("/static", StaticFiles(directory=STATIC), name="static"),
        ]
    )
