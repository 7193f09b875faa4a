"""The engine's server refuses a body past its cap (`--max-request-bytes`) with
a 413 naming the flag, on /tokenize and the completion routes alike."""

from __future__ import annotations

from typing import Any

import httpx

from legorl_jax.core.body_limit import DEFAULT_MAX_REQUEST_BYTES


def test_oversized_bodies_get_413(engine: Any) -> None:
    text = "x" * DEFAULT_MAX_REQUEST_BYTES
    for path, body in (("/tokenize", {"prompt": text}), ("/v1/completions", {"model": "m", "prompt": text})):
        reply = httpx.post(f"{engine.url}{path}", json=body, timeout=60)
        assert reply.status_code == 413, reply.text[:300]
        assert "--max-request-bytes" in reply.json()["error"]["message"]
    # Under the cap, /tokenize answers as before.
    assert httpx.post(f"{engine.url}/tokenize", json={"prompt": "hello"}, timeout=60).status_code == 200
