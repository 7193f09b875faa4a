"""One client for any engine that serves vLLM's HTTP surface (vLLM itself, or
the embedded JAX engine): tokens-in/tokens-out completions with logprobs,
tokenize, health, and the pause → reload → reset → resume weight update.

`EngineClient` is the client; `SyncEngineClient` runs its methods from
blocking code. A client of an engine this process launched reports each installed version to its
launcher (`EngineWatch`), which restarts a crashed engine on it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
import time
from collections.abc import AsyncIterator, Coroutine
from typing import Any, Literal, Protocol, TypeVar

import httpx

PauseMode = Literal["abort", "wait", "keep"]
_T = TypeVar("_T")
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
class TokenCompletion:
    """One choice of a completion, by token id."""

    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str | None
    stop_reason: int | str | None
    prompt_token_ids: list[int] | None
    prompt_logprobs: list[float | None] | None
    # (label, start, end) runs over token_ids: the weights that sampled each token
    # (return_weight_versions); None when the engine gave none (vLLM before 0.33, or not asked).
    weight_versions: list[tuple[str, int, int]] | None = None


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


def _weight_versions(choice: dict[str, Any], n_tokens: int) -> list[tuple[str, int, int]] | None:
    """vLLM 0.33's `weight_versions` spans, checked to cover the output tokens in order."""
    spans = choice.get("weight_versions")
    if spans is None:
        return None
    try:
        out = [(str(s["version"]), int(s["start"]), int(s["end"])) for s in spans]
    except (TypeError, KeyError, ValueError) as exc:
        raise EngineError(200, f"malformed weight_versions {spans!r}: {exc!r}", "ProtocolError") from None
    ends = [0] + [end for _, _, end in out]
    if any(start != ends[i] or end <= start for i, (_, start, end) in enumerate(out)) or ends[-1] != n_tokens:
        raise EngineError(200, f"weight_versions {spans!r} do not cover the {n_tokens} output tokens", "ProtocolError")
    return out


def parse_choice(choice: dict[str, Any]) -> TokenCompletion:
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
    return TokenCompletion(
        token_ids=[int(t) for t in token_ids],
        logprobs=[float(x) for x in logprobs],
        text=choice.get("text", ""),
        finish_reason=choice.get("finish_reason"),
        stop_reason=choice.get("stop_reason"),
        prompt_token_ids=choice.get("prompt_token_ids"),
        prompt_logprobs=_prompt_logprobs(choice),
        weight_versions=_weight_versions(choice, len(token_ids)),
    )


# The token-in/token-out route of vLLM 0.32 (entrypoints/scale_out/token_in_token_out/):
# where its /v1/completions gives no per-token weight versions, this route does.
GENERATE_PATH = "/inference/v1/generate"
TokenRoute = Literal["completions", "generate"]
# Fields of a completions body that the generate route takes outside its sampling_params, or not at all.
_OUTSIDE_SAMPLING = {"model", "prompt", "stream", "return_tokens_as_token_ids", "return_weight_versions",
                     "return_token_ids"}  # fmt: skip


def generate_body(prompt: list[int], model: str, **sampling: Any) -> dict[str, Any]:
    """The generate route's request for what `completion_body` asks of /v1/completions
    (token ids in; its sampling fields, ignore_eos and the like too, go into sampling_params)."""
    body = completion_body(prompt, model, **sampling)
    params = {k: v for k, v in body.items() if k not in _OUTSIDE_SAMPLING}
    return {"model": model, "token_ids": prompt, "sampling_params": params, "output_mode": "tokens"}


def parse_generate(response: dict[str, Any]) -> list[TokenCompletion]:
    """The generate route's answer as completions: logprobs under `logprobs.content`,
    prompt logprobs (keyed by token id) beside the choices."""
    prompt_ids = response.get("prompt_token_ids")
    entries = response.get("prompt_logprobs")
    prompt_logprobs = None
    if entries is not None:
        prompt_logprobs = _prompt_logprobs({"prompt_logprobs": entries, "prompt_token_ids": prompt_ids})
    out = []
    for choice in response["choices"]:
        token_ids = [int(t) for t in choice.get("token_ids") or []]
        content = (choice.get("logprobs") or {}).get("content") or []
        if [int(c["token_id"]) for c in content] != token_ids:
            raise EngineError(200, "generate: logprobs do not pair with token_ids", "ProtocolError")
        out.append(
            TokenCompletion(
                token_ids=token_ids,
                logprobs=[float(c["logprob"]) for c in content],
                text="",
                finish_reason=choice.get("finish_reason"),
                stop_reason=choice.get("stop_reason"),
                prompt_token_ids=prompt_ids,
                prompt_logprobs=prompt_logprobs,
                weight_versions=_weight_versions(choice, len(token_ids)),
            )
        )
    return out


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


def check_prompt_logprobs(sampling: dict[str, Any], unit_temperature: bool) -> None:
    """Prompt logprobs stand in for behaviour logprobs (recompute_logprobs), so they
    must be at the sampling temperature. vLLM computes them at temperature 1 whatever
    the request says (`unit_temperature`): there, any other temperature is refused."""
    temperature = sampling.get("temperature", 1.0)
    if unit_temperature and sampling.get("prompt_logprobs") is not None and temperature != 1.0:
        raise EngineError(
            400,
            f"this engine computes prompt logprobs at temperature 1, not the request's {temperature}: they "
            "would not match the sampled tokens' logprobs; sample at temperature 1 or turn recompute_logprobs off",
            "UnsupportedRequest",
            "prompt_logprobs",
        )


class EngineWatch(Protocol):
    """The launcher of an engine, as its clients see it (ManagedEngine)."""

    def epoch(self) -> int:
        """Bumped by every restart of the engine process."""
        ...

    def installed(self) -> str | None:
        """The weights directory the engine serves now (None: unknown)."""
        ...

    def record(self, epoch: int, weights_path: str, label: str | None = None) -> bool:
        """Marks `weights_path` installed (its tokens labelled `label`) unless the engine restarted since `epoch`."""
        ...

    def restart(self, reason: str) -> None:
        """Kills the engine; it comes back on `installed()`, under its label."""
        ...

    def state(self) -> str:
        """The launcher's word on the engine: "healthy" once a (re)start is done, its
        label and probe included; "failed" once it stopped restarting it."""
        ...


RESET_RUNNING = {"reset_running_requests": "true"}  # preempt paused requests: they recompute under the new weights


class EngineClient:
    """Async client. `watch` is the launcher of the engine (None: an engine run
    elsewhere); `unit_temperature_prompt_logprobs` marks vLLM (check_prompt_logprobs)."""

    def __init__(
        self,
        base_url: str,
        *,
        model: str | None = None,
        timeout: float = 600.0,
        watch: EngineWatch | None = None,
        unit_temperature_prompt_logprobs: bool = False,
        reload_method: str = "reload_weights",
        token_route: TokenRoute = "completions",
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.token_route = token_route  # where token-id prompts go: /v1/completions, or the generate route
        self.watch = watch
        self.unit_temperature_prompt_logprobs = unit_temperature_prompt_logprobs
        # The worker method /collective_rpc reloads with: vLLM's own, or the launcher's
        # extension of it (`rollout_server.backends.vllm.RELOAD_METHOD`) on a vLLM it launched.
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

    async def wait_for_restart(self, epoch: int, timeout: float) -> None:
        """Until the launcher has restarted the engine since `epoch`, relabelled and probed
        it, and it answers /health."""
        deadline = time.monotonic() + timeout
        while (
            self.watch is None
            or self.watch.epoch() == epoch
            or self.watch.state() != "healthy"
            or not await self.healthy()
        ):
            if self.watch is not None and self.watch.state() == "failed":
                raise EngineError(0, "the engine's launcher gave up restarting it", "EngineFailed")
            if time.monotonic() > deadline:
                raise EngineError(0, f"the engine did not come back within {timeout:g} s of its restart", "Timeout")
            await asyncio.sleep(0.5)

    async def model(self) -> str:
        if self._model is None:
            data = (await self._get("/v1/models")).json()["data"]
            self._model = data[0]["id"]
        return self._model

    async def served_context(self) -> int:
        """The context the engine serves: `max_model_len` of its /v1/models card (vLLM and
        the embedded engine both give it). A card without one is an error, never a guess."""
        data = (await self._get("/v1/models")).json().get("data") or [{}]
        value = data[0].get("max_model_len") if isinstance(data[0], dict) else None
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise EngineError(
                200, f"{self.base_url}/v1/models gives no usable max_model_len (got {value!r})", "ProtocolError"
            )
        return value

    async def complete(
        self, prompt: list[int] | str, *, model: str | None = None, **sampling: Any
    ) -> list[TokenCompletion]:
        """A completion of the served model, or of the adapter `model` names."""
        check_prompt_logprobs(sampling, self.unit_temperature_prompt_logprobs)
        model = model or await self.model()
        if self.token_route == "generate" and isinstance(prompt, list):
            return parse_generate(await self._post(GENERATE_PATH, generate_body(prompt, model, **sampling)))
        body = completion_body(prompt, model, **sampling)
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

    async def reset_prefix_cache(self) -> bool | None:
        """Whether the reset took: vLLM 0.33 answers {"success": bool}; 0.17 and
        the embedded engine give no verdict (None), and with running requests
        preempted vLLM's scheduler cannot refuse the reset."""
        body = await self._post("/reset_prefix_cache", params=RESET_RUNNING)
        success = body.get("success") if isinstance(body, dict) else None
        return None if success is None else bool(success)

    async def reload_weights(self, weights_path: str) -> dict[str, Any]:
        """The worker's reload (`reload_method`), which runs vLLM's post-load processing."""
        return await self._post(
            "/collective_rpc", {"method": self.reload_method, "kwargs": {"weights_path": weights_path}}
        )

    async def label_weights(self, version: str) -> bool:
        """Labels the served weights for the tokens sampled from now on (vLLM 0.33's
        `POST /update_weight_version`, which the embedded engine serves too).
        False where the engine has no such route (vLLM before 0.33): its tokens carry no versions."""
        try:
            await self._post("/update_weight_version", {"new_version": version})
        except EngineError as exc:
            if exc.status == 404:
                return False
            raise
        return True

    async def _post_text(self, path: str, body: dict[str, Any]) -> str:
        """POST to a route that answers plain text (vLLM's adapter routes), raising its errors."""
        try:
            response = await self._http.post(path, json=body)
        except httpx.HTTPError as exc:
            raise EngineError(0, f"POST {path}: {exc!r}", "ConnectionError") from exc
        raise_for_error(response)
        return response.text

    async def load_adapter(self, name: str, adapter_dir: str) -> str:
        """Serves the PEFT adapter in `adapter_dir` as model `name` (vLLM's /v1/load_lora_adapter: the
        engine needs --enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING); vLLM refuses a name it serves."""
        return await self._post_text("/v1/load_lora_adapter", {"lora_name": name, "lora_path": adapter_dir})

    async def unload_adapter(self, name: str) -> str:
        """Stops serving the adapter `name` (vLLM's /v1/unload_lora_adapter); requests naming it get 404."""
        return await self._post_text("/v1/unload_lora_adapter", {"lora_name": name})

    async def replace_adapter(self, name: str, adapter_dir: str) -> str:
        """A new version of the adapter `name`: unloaded, then `adapter_dir` loaded (requests naming it
        in between get 404). Not vLLM's load_inplace: every later request carries that flag, and the
        worker reads the adapter from disk again at each step (vllm/lora/worker_manager.py, add_adapter;
        decode through it ran a third to a half slower: scripts/bench_lora_publish.py). Give each version
        its own directory: vLLM keys prefix-cache blocks by (name, path)."""
        await self.unload_adapter(name)
        return await self.load_adapter(name, adapter_dir)

    async def _load(self, weights_path: str) -> dict[str, Any]:
        result = await self.reload_weights(weights_path)
        if await self.reset_prefix_cache() is False:
            raise EngineError(
                200,
                f"prefix cache not reset after loading {weights_path}: KV from the old weights would be reused",
                "PrefixCacheNotReset",
            )
        return result

    async def update_weights(
        self, weights_path: str, mode: PauseMode = "keep", version: str | None = None
    ) -> dict[str, Any]:
        """pause → reload → reset prefix cache → label `version` → resume. With
        mode keep, requests in flight resume under the new weights, and their
        later tokens carry the new label. Resume runs whatever failed, so no
        request hangs on a paused engine. A failed update raises EngineError
        with the engine back on its previous weights (and label): reloaded, or,
        where that fails too, restarted on them by its launcher."""
        epoch = self.watch.epoch() if self.watch is not None else 0
        restarted = False
        try:
            await self.pause(mode)
            try:
                result = await self._load(weights_path)
                if version is not None:
                    await self.label_weights(version)
            except EngineError as exc:
                where, restarted = await self._restore(weights_path, epoch)
                raise EngineError(exc.status, f"{exc.message}; {where}", exc.err_type, exc.param) from exc
        finally:
            if not restarted:
                await self.resume()
        if self.watch is not None and not self.watch.record(epoch, weights_path, version):
            raise EngineError(
                0,
                f"the engine restarted during the update to {weights_path}; it serves {self.watch.installed()}",
                "EngineRestarted",
            )
        return result

    async def _restore(self, weights_path: str, epoch: int) -> tuple[str, bool]:
        """After a failed load, the previous weights again: where the engine now
        stands, and whether that took a restart. Without a launcher nobody knows
        the previous weights, and the message says the engine's are unknown."""
        previous = self.watch.installed() if self.watch is not None else None
        if self.watch is None or previous is None:
            return "the engine's weights are now unknown", False
        if self.watch.epoch() != epoch:  # it crashed meanwhile and restarts on them anyway
            return f"the engine restarted and comes back on {previous}", True
        try:
            await self._load(previous)
            return f"the engine serves {previous} again", False
        except EngineError as again:
            self.watch.restart(f"update to {weights_path} failed and {previous} could not be reloaded: {again}")
            return f"the engine is restarting on {previous}", True


class SyncEngineClient:
    """Blocking face of `EngineClient` for scripts, launchers and tests: each call
    runs the async client's method on a private event loop thread, so both share
    one implementation and the blocking one may be called from many threads."""

    def __init__(self, base_url: str, **settings: Any) -> None:
        self._async = EngineClient(base_url, **settings)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="engine-client", daemon=True)
        self._thread.start()
        self.base_url, self.watch = self._async.base_url, self._async.watch

    def _run(self, coro: Coroutine[Any, Any, _T]) -> _T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def close(self) -> None:
        if self._loop.is_closed():
            return
        self._run(self._async.aclose())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def healthy(self) -> bool:
        return self._run(self._async.healthy())

    def model(self) -> str:
        return self._run(self._async.model())

    def complete(self, prompt: list[int] | str, **sampling: Any) -> list[TokenCompletion]:
        return self._run(self._async.complete(prompt, **sampling))

    def update_weights(self, weights_path: str, mode: PauseMode = "keep", version: str | None = None) -> dict[str, Any]:
        return self._run(self._async.update_weights(weights_path, mode, version))

    def label_weights(self, version: str) -> bool:
        return self._run(self._async.label_weights(version))

    def load_adapter(self, name: str, adapter_dir: str) -> str:
        return self._run(self._async.load_adapter(name, adapter_dir))

    def unload_adapter(self, name: str) -> str:
        return self._run(self._async.unload_adapter(name))

    def replace_adapter(self, name: str, adapter_dir: str) -> str:
        return self._run(self._async.replace_adapter(name, adapter_dir))

    def run(self, coro: Coroutine[Any, Any, _T]) -> _T:
        """Runs a coroutine of the async client (`async_client`) to its end."""
        return self._run(coro)

    @property
    def async_client(self) -> EngineClient:
        return self._async
