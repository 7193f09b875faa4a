"""The embedded engine and its HTTP server on a background thread (tests, the
in-process rollout server); `legorl serve` runs it in the foreground."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from legorl_jax.serve.app import create_app
from legorl_jax.serve.drain import BackgroundServer
from legorl_jax.serve.loader import ServedModel, load_served_model


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
