"""Tokens in, tokens out: the one engine call the proxy makes.

`POST {engine}/v1/completions` with the prompt as token ids, served alike by
vLLM and the embedded JAX engine; or, with `token_route="generate"`, vLLM 0.32's
token-in/token-out route, the one of that version that reports per-token
weight versions. Request bodies and response parsing are the
rollout backends' (`rollout_server.backends.client`: ids from `token_ids`, or
from "token_id:<n>" logprob tokens, paired with logprobs by position); this
adapter applies the session's sampling and turns every engine failure into
the proxy's `engine_unavailable`, which each dialect answers as a 503.
Prompt logprobs (recompute_logprobs) are refused, as a 400, from an engine that
computes them at temperature 1 when the session samples at another. Each call
asks for the weight version of every sampled token (`return_weight_versions`:
the policy version the rollout server labelled the weights with); an engine
that gives none, or labels that are not policy versions, leave them unknown.

The transport is `engine_transport` (keep-alive connections, the least CPU
per call: this hop is on every model call); bodies are serialised and parsed
by orjson (`jsonio`), many times faster than the standard library's encoder
over a long prompt (docs/benchmarks.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import httpx

from rollout_server.backends.adapters import AdapterRoute
from rollout_server.backends.client import (
    GENERATE_PATH,
    EngineError,
    TokenCompletion,
    TokenRoute,
    check_prompt_logprobs,
    completion_body,
    generate_body,
    parse_choice,
    parse_generate,
    raise_for_error,
)
from rollout_server.proxy import jsonio
from rollout_server.proxy.engine_transport import EngineConnectionError, EngineTransport
from rollout_server.proxy.errors import ProxyError, invalid


@dataclass(frozen=True)
class CompletionParams:
    temperature: float
    top_p: float
    top_k: int
    max_tokens: int
    stop_token_ids: tuple[int, ...]
    prompt_logprobs: bool = False  # also the logprob of each prompt token under the engine's weights
    seed: int | None = None  # None: the engine draws one

    def record(self) -> dict[str, Any]:
        """The fields, for the call record: a shallow copy (every field is
        immutable) where `dataclasses.asdict` would deep-copy each one."""
        return dict(vars(self))

    def as_kwargs(self) -> dict[str, Any]:
        return {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "max_tokens": self.max_tokens,
            "stop_token_ids": list(self.stop_token_ids),
            # 0: the prompt token's own logprob, no alternatives (vLLM's convention).
            "prompt_logprobs": 0 if self.prompt_logprobs else None,
            "seed": self.seed,
        }


@dataclass(frozen=True)
class EngineCompletion:
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: str  # "stop" or "length"
    prompt_logprobs: tuple[float | None, ...] | None = None  # per prompt position, when asked for
    # The policy version that sampled each token; None when the engine did not say.
    versions: tuple[int, ...] | None = None


def token_versions(spans: list[tuple[str, int, int]] | None) -> tuple[int, ...] | None:
    """Per-token policy versions from weight-version spans (already checked to
    cover the tokens). None when any label is not a policy version: the engine
    was never labelled ("default"), or was restarted since it was."""
    if spans is None or not all(label.isdigit() for label, _, _ in spans):
        return None
    return tuple(int(label) for label, start, end in spans for _ in range(end - start))


class ProxyEngineClient:
    """The proxy's client of one engine URL, shared by all sessions.
    `unit_temperature_prompt_logprobs` marks an engine that computes prompt
    logprobs at temperature 1 whatever the request says (vLLM)."""

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        timeout_s: float = 3600.0,
        unit_temperature_prompt_logprobs: bool = False,
        token_route: TokenRoute = "completions",
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.token_route = token_route
        self.model = model
        self.timeout_s = timeout_s
        self.unit_temperature_prompt_logprobs = unit_temperature_prompt_logprobs
        # The adapter version requests name, on an engine serving them by name (the host sets it).
        self.adapters = AdapterRoute()
        self._transport = EngineTransport(self.base_url)

    def check_recompute(self, temperature: float) -> None:
        """Refuses (400) prompt logprobs for a session sampling at `temperature`
        where this engine computes them at another: recomputed logprobs must
        match the ones the sampled tokens were drawn with."""
        try:
            check_prompt_logprobs(
                {"temperature": temperature, "prompt_logprobs": 0}, self.unit_temperature_prompt_logprobs
            )
        except EngineError as exc:
            raise invalid(f"recompute_logprobs at sampling.temperature {temperature}: {exc.message}") from None

    async def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        try:
            status, raw = await self._transport.post(path, jsonio.dumps(body), self.timeout_s)
        except (EngineConnectionError, TimeoutError) as exc:
            raise EngineError(0, f"POST {path}: {exc!r}", "ConnectionError") from exc
        if status >= 400:  # the backends' reading of an error body (vLLM's shapes), unchanged
            raise_for_error(httpx.Response(status, content=raw))
        return dict(jsonio.loads(raw))

    async def complete(self, prompt_ids: list[int], sampling: CompletionParams) -> EngineCompletion:
        if sampling.prompt_logprobs:
            self.check_recompute(sampling.temperature)
        with self.adapters.use() as adapter:
            choices = await self._complete(prompt_ids, sampling, self.model if adapter is None else adapter.name)
        if len(choices) != 1:
            raise ProxyError("engine_unavailable", f"inference engine sent {len(choices)} choices, asked for 1")
        choice = choices[0]
        if not all(math.isfinite(x) for x in choice.logprobs):
            raise ProxyError("engine_unavailable", "inference engine sent a non-finite logprob for a sampled token")
        prompt = choice.prompt_logprobs if sampling.prompt_logprobs else None
        if prompt is not None and len(prompt) != len(prompt_ids):
            raise ProxyError(
                "engine_unavailable",
                f"inference engine sent {len(prompt)} prompt logprobs for {len(prompt_ids)} prompt tokens",
            )
        return EngineCompletion(
            tuple(choice.token_ids),
            tuple(choice.logprobs),
            choice.finish_reason or "stop",
            None if prompt is None else tuple(prompt),
            # A request through an adapter is sampled by it throughout (`AdapterRoute`).
            token_versions(choice.weight_versions) if adapter is None else (adapter.version,) * len(choice.token_ids),
        )

    async def _complete(self, prompt_ids: list[int], sampling: CompletionParams, model: str) -> list[TokenCompletion]:
        try:
            if self.token_route == "generate":
                body = generate_body(prompt_ids, model, **sampling.as_kwargs())
                return parse_generate(await self._post(GENERATE_PATH, body))
            body = completion_body(
                prompt_ids,
                model,
                **sampling.as_kwargs(),
                # Ids also as logprob tokens, for engines without return_token_ids.
                return_tokens_as_token_ids=True,
                return_weight_versions=True,
            )
            return [parse_choice(c) for c in (await self._post("/v1/completions", body))["choices"]]
        except EngineError as exc:
            raise ProxyError("engine_unavailable", f"inference engine failed: {exc}") from exc
        except (TypeError, ValueError, KeyError) as exc:  # a body that breaks the completions contract
            raise ProxyError("engine_unavailable", f"inference engine sent a malformed completion: {exc!r}") from exc

    async def aclose(self) -> None:
        await self._transport.aclose()
