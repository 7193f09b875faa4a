"""Runs the embedded engine's app under uvicorn: in the foreground (`legorl
serve`) or on a background thread (tests, the in-process rollout server)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import uvicorn

from legorl_jax.serve.app import create_app
from legorl_jax.serve.loader import ServedModel, load_served_model


class BackgroundServer:
    """uvicorn on a thread; port 0 picks a free port, read back from `url`."""

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0) -> None:
        config = uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="legorl-uvicorn", daemon=True)
        self.host = host
        self.url = ""

    def start(self, timeout: float = 60.0) -> BackgroundServer:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        port = self._server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://{self.host}:{port}"
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=30)


class EmbeddedEngine:
    """A loaded model, its engine thread and its HTTP server, stopped together."""

    def __init__(self, served: ServedModel, server: BackgroundServer) -> None:
        self.served = served
        self.server = server

    @property
    def url(self) -> str:
        return self.server.url

    @classmethod
    def start(
        cls,
        model_dir: str | Path,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        return_tokens_as_token_ids: bool = False,
        **engine_kwargs: Any,
    ) -> EmbeddedEngine:
        served = load_served_model(model_dir, **engine_kwargs)
        try:
            app = create_app(served, return_tokens_as_token_ids=return_tokens_as_token_ids)
            server = BackgroundServer(app, host, port).start()
        except BaseException:
            served.engine.shutdown()
            raise
        return cls(served, server)

    def stop(self) -> None:
        self.server.stop()
        self.served.engine.shutdown()

    def __enter__(self) -> EmbeddedEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
