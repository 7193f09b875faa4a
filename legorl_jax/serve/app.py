"""The embedded engine's HTTP surface: the subset of vLLM's server the project
calls, with vLLM's paths, bodies and error shapes.

Weight reload is vLLM's dev-mode sequence: `POST /pause`, `POST /collective_rpc`
`{"method": "reload_weights", "kwargs": {"weights_path": DIR}}`,
`POST /reset_prefix_cache`, `POST /update_weight_version` (the policy label
sampled tokens carry: `return_weight_versions`), `POST /resume`. Each reports
the loaded `weight_version` (reloads since start) so a caller can confirm what
it is talking to.
"""

from __future__ import annotations

import asyncio
import time
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from legorl_jax.core.body_limit import DEFAULT_MAX_REQUEST_BYTES, BodyLimit
from legorl_jax.core.engine_api import PauseMode
from legorl_jax.core.surrogates import replace_lone_surrogates
from legorl_jax.serve.completions import CompletionRun, EngineFailure
from legorl_jax.serve.loader import ServedModel, WeightsError
from legorl_jax.serve.protocol import (
    CollectiveRpcRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    UpdateWeightVersionRequest,
    error_body,
)

# collective_rpc methods that reload weights from a directory: vLLM's own name,
# and the method of the project's vLLM worker extension, so one client call
# works against either engine.
RELOAD_METHODS = ("reload_weights", "reload_weights_from_path")


class ApiError(Exception):
    def __init__(self, status: HTTPStatus, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param

    def response(self) -> JSONResponse:
        kind = {400: "BadRequestError", 404: "NotFoundError", 503: "ServiceUnavailableError"}.get(
            self.status.value, "InternalServerError"
        )
        return JSONResponse(error_body(self.message, kind, self.status.value, self.param), self.status.value)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    parts, param = [], None
    for err in exc.errors():
        loc = [str(p) for p in err.get("loc", ()) if p not in ("body",)]
        param = param or (loc[0] if loc else None)
        parts.append(f"{'.'.join(loc) or 'body'}: {err.get('msg')}")
    return "; ".join(parts) or "invalid request", param


class _EngineCollector:
    """Prometheus view of the engine's counters, in vLLM's metric names."""

    def __init__(self, served: ServedModel) -> None:
        self.served = served

    def collect(self) -> Any:
        stats = self.served.engine.stats()
        labels = {"model_name": self.served.name}
        for name, key, doc in (
            ("vllm:num_requests_running", "running", "Requests in engine slots."),
            ("vllm:num_requests_waiting", "waiting", "Requests waiting for a slot."),
            ("legorl:weight_version", "weight_version", "Weight reloads since start."),
            ("legorl:kv_cache_blocks_used", "kv_blocks_used", "KV-cache blocks held by requests."),
            ("legorl:kv_cache_blocks_total", "kv_blocks_total", "KV-cache blocks in the pool."),
        ):
            gauge = GaugeMetricFamily(name, doc, labels=list(labels))
            gauge.add_metric(list(labels.values()), stats[key])
            yield gauge
        usage = GaugeMetricFamily(
            "vllm:kv_cache_usage_perc", "Fraction of KV-cache blocks in use.", labels=list(labels)
        )
        usage.add_metric(list(labels.values()), stats["kv_blocks_used"] / max(1, stats["kv_blocks_total"]))
        yield usage
        for name, key, doc in (
            ("vllm:prompt_tokens", "prompt_tokens", "Prompt tokens admitted."),
            ("vllm:generation_tokens", "generation_tokens", "Tokens generated."),
            ("legorl:engine_steps", "steps", "Device steps run."),
            ("legorl:requests_finished", "finished", "Requests that left their slot."),
            ("vllm:prefix_cache_queries", "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
            ("vllm:prefix_cache_hits", "prefix_cache_hits", "Prompt tokens found in the prefix cache."),
        ):
            counter = CounterMetricFamily(name, doc, labels=list(labels))
            counter.add_metric(list(labels.values()), stats[key])
            yield counter


def create_app(
    served: ServedModel, *, return_tokens_as_token_ids: bool = False, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
) -> FastAPI:
    app = FastAPI(title="legorl embedded engine")
    app.add_middleware(BodyLimit, limit=max_request_bytes, setting="legorl serve --max-request-bytes")
    engine = served.engine
    registry = CollectorRegistry()
    registry.register(_EngineCollector(served))

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return ApiError(HTTPStatus.BAD_REQUEST, message, param).response()

    def check_model(name: str | None) -> None:
        if name is not None and name != served.name:
            raise ApiError(HTTPStatus.NOT_FOUND, f"The model `{name}` does not exist.", "model")

    def versioned(**extra: Any) -> dict[str, Any]:
        return {**extra, "weight_version": engine.weight_version, "weights_path": str(served.weights_path)}

    @app.get("/health")
    async def health() -> Response:
        if not engine.healthy:
            raise ApiError(HTTPStatus.SERVICE_UNAVAILABLE, "the engine loop is not running")
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {
            "id": served.name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "legorl",
            "root": str(served.model_dir),
            "parent": None,
            "max_model_len": engine.max_len,
        }
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions", response_model=None)
    async def completions(req: CompletionRequest) -> Any:
        check_model(req.model)
        try:
            run = CompletionRun(served, req, return_tokens_as_token_ids)
        except ValueError as exc:  # empty prompt, out-of-vocabulary ids, ContextLengthError
            raise ApiError(HTTPStatus.BAD_REQUEST, str(exc), "prompt") from exc
        try:
            run.start()
        except RuntimeError as exc:  # the engine is shutting down or its loop died
            run.abort_unfinished()
            raise ApiError(HTTPStatus.SERVICE_UNAVAILABLE, str(exc)) from exc
        if req.stream:
            return StreamingResponse(run.stream(), media_type="text/event-stream")
        try:
            return (await run.collect()).model_dump()
        except EngineFailure as exc:
            raise ApiError(HTTPStatus.INTERNAL_SERVER_ERROR, str(exc)) from exc

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> dict[str, Any]:
        check_model(req.model)
        tok = served.tokenizer
        if req.messages is not None:
            try:
                ids = tok.apply_chat_template(
                    replace_lone_surrogates([m.model_dump(exclude_none=True) for m in req.messages]),
                    tools=replace_lone_surrogates(req.tools),
                    add_generation_prompt=req.add_generation_prompt,
                    continue_final_message=req.continue_final_message,
                    tokenize=True,
                    return_dict=False,
                    **(req.chat_template_kwargs or {}),
                )
            except Exception as exc:  # template errors (raise_exception) are the caller's
                raise ApiError(HTTPStatus.BAD_REQUEST, f"chat template failed: {exc}", "messages") from exc
        else:
            ids = tok.encode(replace_lone_surrogates(req.prompt), add_special_tokens=req.add_special_tokens)
        body: dict[str, Any] = {"count": len(ids), "max_model_len": engine.max_len, "tokens": list(ids)}
        if req.return_token_strs:
            body["token_strs"] = tok.convert_ids_to_tokens(list(ids))
        return body

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> dict[str, str]:
        check_model(req.model)
        bad = [t for t in req.tokens if not 0 <= t < engine.vocab_size]
        if bad:
            raise ApiError(HTTPStatus.BAD_REQUEST, f"token id {bad[0]} is out of vocabulary", "tokens")
        return {"prompt": served.tokenizer.decode(req.tokens)}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type="text/plain; version=0.0.4")

    @app.post("/pause")
    async def pause(
        mode: PauseMode = Query("abort"), wait_for_inflight_requests: bool = Query(False)
    ) -> dict[str, Any]:
        # Older vLLM spelled "wait" as a boolean flag; both are accepted.
        chosen: PauseMode = "wait" if wait_for_inflight_requests else mode
        await asyncio.to_thread(engine.pause, chosen)
        return versioned(status="paused", mode=chosen)

    @app.post("/resume")
    async def resume() -> dict[str, Any]:
        engine.resume()
        return versioned(status="resumed")

    @app.get("/is_paused")
    async def is_paused() -> dict[str, Any]:
        return versioned(is_paused=engine.paused)

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> dict[str, Any]:
        reset = await asyncio.to_thread(engine.reset_cache)
        return versioned(status="reset", slots_reset=reset)

    @app.post("/update_weight_version")
    async def update_weight_version(req: UpdateWeightVersionRequest) -> dict[str, Any]:
        # vLLM 0.33's label for the weights (no load): every token sampled from now on carries it.
        engine.set_version_label(req.new_version)
        return {"success": True, "new_version": req.new_version}

    @app.post("/collective_rpc")
    async def collective_rpc(req: CollectiveRpcRequest) -> dict[str, Any]:
        if req.method not in RELOAD_METHODS:
            raise ApiError(
                HTTPStatus.BAD_REQUEST,
                f"unsupported method {req.method!r}; supported: {list(RELOAD_METHODS)}",
                "method",
            )
        path = req.kwargs.get("weights_path") or (req.args[0] if req.args else None)
        if not isinstance(path, str) or not path:
            raise ApiError(HTTPStatus.BAD_REQUEST, f"{req.method} needs kwargs.weights_path (a directory)", "kwargs")
        try:
            await asyncio.to_thread(served.reload, path)
        except WeightsError as exc:
            raise ApiError(HTTPStatus.BAD_REQUEST, str(exc), "kwargs") from exc
        # vLLM answers {"results": [one entry per worker]}.
        return {"results": [versioned()]}

    return app
