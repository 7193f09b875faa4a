"""Wire dialects: each module turns its provider's request into a
`ChatRequest` and a `TurnResult` into its provider's response, stream events
and error shape."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

from rollout_server.proxy.conversation import ChatRequest
from rollout_server.proxy.errors import ProxyError
from rollout_server.proxy.parsed_items import ItemMemo
from rollout_server.proxy.turn import TurnResult


class Dialect(Protocol):
    name: str
    tool_id_prefix: str

    def parse(self, body: Any, params: dict[str, str], memo: ItemMemo | None = None) -> ChatRequest: ...

    def response(self, result: TurnResult, request: ChatRequest) -> dict[str, Any]: ...

    def stream(self, result: TurnResult, request: ChatRequest) -> Iterable[bytes]: ...

    def error(self, err: ProxyError) -> dict[str, Any]: ...

    def stream_error(self, err: ProxyError) -> bytes: ...
