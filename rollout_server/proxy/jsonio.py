"""JSON on the proxy's hot path: orjson, with the standard library behind it.

Every model call serialises the engine request (the whole prompt as token
ids) and the answer, and parses the engine's reply; orjson does each in a few
microseconds where `json` takes up to a tenth of a millisecond for a long
prompt (scripts/bench_proxy.py). Whatever orjson refuses goes through `json`
unchanged: NaN/Infinity literals (an engine's -Infinity logprob is answered
by the finiteness checks downstream, not as a malformed body), integers
past 64 bits, non-string keys.

Harness bodies are still parsed with `json`: orjson reads integers past 64
bits as floats, which would change tool arguments that sampled turns are
matched by; `json` costs ~10 µs more on a typical body.
"""

from __future__ import annotations

import json
from typing import Any

import orjson
from starlette.responses import JSONResponse


def loads(raw: bytes) -> Any:
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:  # a subclass of json.JSONDecodeError: json's verdict is final
        return json.loads(raw)


def dumps(value: Any) -> bytes:
    """Compact UTF-8 JSON, non-ASCII kept as is (what Starlette's JSONResponse writes)."""
    try:
        return orjson.dumps(value)
    except TypeError:
        return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()


class FastJSONResponse(JSONResponse):
    """Starlette's JSONResponse, serialised by `dumps`."""

    def render(self, content: Any) -> bytes:
        return dumps(content)
