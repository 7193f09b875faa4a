"""One client for any engine that serves vLLM's HTTP surface (vLLM itself, or
the embedded JAX engine): tokens-in/tokens-out completions with logprobs,
tokenize, health, and the pause → reload → reset → resume weight update.

Request bodies and response parsing are plain functions shared by the async
client (`EngineClient`) and the blocking one (`SyncEngineClient`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import AsyncIterator
from typing import Any, Literal

import httpx

PauseMode = Literal["abort", "wait", "keep"]
TOKEN_ID_PREFIX = "token_id:"  # vLLM's --return-tokens-as-token-ids spelling


# Idle connections expire before the servers' own 5 s keep-alive (uvicorn, vLLM):
# reusing one the server is closing at that instant fails with a ReadError.
_LIMITS = httpx.Limits(max_connections=None, max_keepalive_connections=64, keepalive_expiry=2.0)


class EngineError(RuntimeError):
    """The engine answered with an error (vLLM's error body), or not at all."""

    def __init__(self, status: int, message: str, err_type: str = "", param: str | None = None) -> None:
        super().__init__(f"engine error {status} ({err_type or 'unknown'}): {message}")
        self.status, self.message, self.err_type, self.param = status, message, err_type, param


@dataclasses.dataclass(frozen=True)
class Completion:
    """One choice of a completion, by token id."""

    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str | None
    stop_reason: int | str | None
    prompt_token_ids: list[int] | None
    prompt_logprobs: list[float | None] | None


def completion_body(
    prompt: list[int] | str,
    model: str,
    *,
    max_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = -1,
    seed: int | None = None,
    stop: list[str] | None = None,
    stop_token_ids: list[int] | None = None,
    prompt_logprobs: int | None = None,
    stream: bool = False,
    **extra: Any,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "top_p": top_p,
        "top_k": top_k,
        "logprobs": 0,  # the sampled token's logprob only
        "return_token_ids": True,
        "stream": stream,
        **extra,
    }
    optional = {"seed": seed, "stop": stop, "stop_token_ids": stop_token_ids, "prompt_logprobs": prompt_logprobs}
    body.update({k: v for k, v in optional.items() if v is not None})
    return body


def _token_ids_from_logprobs(choice: dict[str, Any]) -> list[int]:
    tokens = (choice.get("logprobs") or {}).get("tokens") or []
    if not all(isinstance(t, str) and t.startswith(TOKEN_ID_PREFIX) for t in tokens):
        raise EngineError(200, "response has neither token_ids nor token_id:<n> logprob tokens", "ProtocolError")
    return [int(t[len(TOKEN_ID_PREFIX) :]) for t in tokens]


def _prompt_logprobs(choice: dict[str, Any]) -> list[float | None] | None:
    entries = choice.get("prompt_logprobs")
    if entries is None:
        return None
    prompt = choice.get("prompt_token_ids") or []
    out: list[float | None] = []
    for i, entry in enumerate(entries):
        if entry is None:
            out.append(None)
        else:
            key = str(prompt[i]) if i < len(prompt) and str(prompt[i]) in entry else next(iter(entry))
            out.append(float(entry[key]["logprob"]))
    return out


def parse_choice(choice: dict[str, Any]) -> Completion:
    """Token ids come from `token_ids` (return_token_ids), else from
    `token_id:<n>` logprob tokens; each id is paired with its logprob by position."""
    token_ids = choice.get("token_ids")
    if token_ids is None:
        token_ids = _token_ids_from_logprobs(choice)
    logprobs = (choice.get("logprobs") or {}).get("token_logprobs") or []
    if len(logprobs) != len(token_ids):
        raise EngineError(
            200, f"{len(token_ids)} token ids but {len(logprobs)} logprobs in one choice", "ProtocolError"
        )
    return Completion(
        token_ids=[int(t) for t in token_ids],
        logprobs=[float(x) for x in logprobs],
        text=choice.get("text", ""),
        finish_reason=choice.get("finish_reason"),
        stop_reason=choice.get("stop_reason"),
        prompt_token_ids=choice.get("prompt_token_ids"),
        prompt_logprobs=_prompt_logprobs(choice),
    )


def raise_for_error(response: httpx.Response) -> None:
    if response.status_code < 400:
        return
    try:
        body = response.json()
    except json.JSONDecodeError:
        raise EngineError(response.status_code, response.text[:500]) from None
    # vLLM's shape is {"error": {...}}; older versions put the fields at the top.
    err = body.get("error", body) if isinstance(body, dict) else {}
    if not isinstance(err, dict):
        err = {"message": str(err)}
    message = err.get("message") or err.get("detail") or json.dumps(body)[:500]
    raise EngineError(response.status_code, str(message), str(err.get("type", "")), err.get("param"))


def reload_request(weights_path: str, method: str) -> dict[str, Any]:
    return {"method": method, "kwargs": {"weights_path": weights_path}}


class EngineClient:
    """Async client. `reload_method` is the collective_rpc method that loads
    weights from a directory (see rollout_server.backends.vllm)."""

    def __init__(
        self, base_url: str, *, model: str | None = None, timeout: float = 600.0, reload_method: str = "reload_weights"
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.reload_method = reload_method
        self._model = model
        self._http = httpx.AsyncClient(base_url=self.base_url, timeout=timeout, limits=_LIMITS)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> EngineClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _post(self, path: str, body: Any = None, params: dict[str, Any] | None = None) -> Any:
        try:
            response = await self._http.post(path, json=body, params=params)
        except httpx.HTTPError as exc:
            raise EngineError(0, f"POST {path}: {exc!r}", "ConnectionError") from exc
        raise_for_error(response)
        return response.json() if response.content else {}

    async def _get(self, path: str) -> httpx.Response:
        try:
            response = await self._http.get(path)
        except httpx.HTTPError as exc:
            raise EngineError(0, f"GET {path}: {exc!r}", "ConnectionError") from exc
        raise_for_error(response)
        return response

    async def healthy(self) -> bool:
        try:
            return (await self._http.get("/health", timeout=5.0)).status_code == 200
        except httpx.HTTPError:
            return False

    async def wait_healthy(self, timeout: float = 600.0, interval: float = 0.5) -> None:
        deadline = time.monotonic() + timeout
        while not await self.healthy():
            if time.monotonic() > deadline:
                raise EngineError(0, f"{self.base_url} not healthy after {timeout:.0f}s", "Timeout")
            await asyncio.sleep(interval)

    async def model(self) -> str:
        if self._model is None:
            data = (await self._get("/v1/models")).json()["data"]
            self._model = data[0]["id"]
        return self._model

    async def complete(self, prompt: list[int] | str, **sampling: Any) -> list[Completion]:
        body = completion_body(prompt, await self.model(), **sampling)
        return [parse_choice(c) for c in (await self._post("/v1/completions", body))["choices"]]

    async def stream(self, prompt: list[int] | str, **sampling: Any) -> AsyncIterator[dict[str, Any]]:
        """Yields the JSON chunks of a streamed completion (until [DONE])."""
        body = completion_body(prompt, await self.model(), stream=True, **sampling)
        async with self._http.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code >= 400:
                await response.aread()
                raise_for_error(response)
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: ") :]
                if data == "[DONE]":
                    return
                chunk = json.loads(data)
                if "error" in chunk:
                    err = chunk["error"]
                    raise EngineError(int(err.get("code") or 500), err.get("message", ""), err.get("type", ""))
                yield chunk

    async def tokenize(self, text: str | None = None, messages: list[dict] | None = None, **options: Any) -> list[int]:
        body: dict[str, Any] = {"model": await self.model(), **options}
        body.update({"prompt": text} if messages is None else {"messages": messages})
        return list((await self._post("/tokenize", body))["tokens"])

    async def pause(self, mode: PauseMode = "keep") -> dict[str, Any]:
        return await self._post("/pause", params={"mode": mode})

    async def resume(self) -> dict[str, Any]:
        return await self._post("/resume")

    async def reset_prefix_cache(self) -> dict[str, Any]:
        return await self._post("/reset_prefix_cache")

    async def reload_weights(self, weights_path: str) -> dict[str, Any]:
        return await self._post("/collective_rpc", reload_request(weights_path, self.reload_method))

    async def update_weights(self, weights_path: str, mode: PauseMode = "keep") -> dict[str, Any]:
        """pause → reload → reset_prefix_cache → resume. The engine is resumed
        even when the reload fails, so in-flight requests never hang on it."""
        await self.pause(mode)
        try:
            result = await self.reload_weights(weights_path)
            await self.reset_prefix_cache()
        finally:
            await self.resume()
        return result


class SyncEngineClient:
    """Blocking client for scripts and launchers: health, completions, weight update."""

    def __init__(
        self, base_url: str, *, model: str | None = None, timeout: float = 600.0, reload_method: str = "reload_weights"
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.reload_method = reload_method
        self._model = model
        self._http = httpx.Client(base_url=self.base_url, timeout=timeout, limits=_LIMITS)

    def close(self) -> None:
        self._http.close()

    def _post(self, path: str, body: Any = None, params: dict[str, Any] | None = None) -> Any:
        try:
            response = self._http.post(path, json=body, params=params)
        except httpx.HTTPError as exc:
            raise EngineError(0, f"POST {path}: {exc!r}", "ConnectionError") from exc
        raise_for_error(response)
        return response.json() if response.content else {}

    def healthy(self) -> bool:
        try:
            return self._http.get("/health", timeout=5.0).status_code == 200
        except httpx.HTTPError:
            return False

    def model(self) -> str:
        if self._model is None:
            response = self._http.get("/v1/models")
            raise_for_error(response)
            self._model = response.json()["data"][0]["id"]
        return self._model

    def complete(self, prompt: list[int] | str, **sampling: Any) -> list[Completion]:
        body = completion_body(prompt, self.model(), **sampling)
        return [parse_choice(c) for c in self._post("/v1/completions", body)["choices"]]

    def update_weights(self, weights_path: str, mode: PauseMode = "keep") -> dict[str, Any]:
        """See EngineClient.update_weights."""
        self._post("/pause", params={"mode": mode})
        try:
            result = self._post("/collective_rpc", reload_request(weights_path, self.reload_method))
            self._post("/reset_prefix_cache")
        finally:
            self._post("/resume")
        return result
