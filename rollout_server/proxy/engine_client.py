"""Tokens in, tokens out: the one engine call the proxy makes.

`POST {engine}/v1/completions` with the prompt as token ids, served alike by
vLLM and the embedded JAX engine. Request and response handling are the
rollout backends' (`rollout_server.backends.client`: ids from `token_ids`, or
from "token_id:<n>" logprob tokens, paired with logprobs by position); this
adapter applies the session's sampling and turns every engine failure into
the proxy's `engine_unavailable`, which each dialect answers as a 503.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from rollout_server.backends.client import EngineClient as BackendClient
from rollout_server.backends.client import EngineError
from rollout_server.proxy.errors import ProxyError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float
    top_p: float
    top_k: int
    max_tokens: int
    stop_token_ids: tuple[int, ...]

    def as_kwargs(self) -> dict[str, Any]:
        return {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
                "max_tokens": self.max_tokens, "stop_token_ids": list(self.stop_token_ids)}


@dataclass(frozen=True)
class EngineCompletion:
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: str  # "stop" or "length"


class EngineClient:
    """The proxy's client of one engine URL, shared by all sessions."""

    def __init__(self, base_url: str, model: str, *, timeout_s: float = 3600.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.model = model
        self._backend = BackendClient(self.base_url, model=model, timeout=timeout_s)

    async def complete(self, prompt_ids: list[int], sampling: SamplingParams) -> EngineCompletion:
        try:
            choices = await self._backend.complete(
                prompt_ids, **sampling.as_kwargs(),
                # Ids also as logprob tokens, for engines without return_token_ids.
                return_tokens_as_token_ids=True,
            )
        except EngineError as exc:
            raise ProxyError("engine_unavailable", f"inference engine failed: {exc}") from exc
        except (TypeError, ValueError, KeyError) as exc:  # a body that breaks the completions contract
            raise ProxyError("engine_unavailable", f"inference engine sent a malformed completion: {exc!r}") from exc
        if len(choices) != 1:
            raise ProxyError("engine_unavailable", f"inference engine sent {len(choices)} choices, asked for 1")
        choice = choices[0]
        if not all(math.isfinite(x) for x in choice.logprobs):
            raise ProxyError("engine_unavailable", "inference engine sent a non-finite logprob for a sampled token")
        return EngineCompletion(tuple(choice.token_ids), tuple(choice.logprobs), choice.finish_reason or "stop")

    async def aclose(self) -> None:
        await self._backend.aclose()
