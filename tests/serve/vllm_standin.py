"""TEST INSTRUMENT: a stand-in `vllm` executable, for what the real one cannot show here.

The real vLLM (0.32, set-up's CPU build) runs in the suites that hold the
project to it: tests/contract (the engine surface, the native reload, per-token
labels on its generate route) and tests/rollout/test_vllm_host.py (a host on it:
trials, updates mid-trial, a kill -9). This stand-in is kept only for (1) the
versions that cannot be installed here: 0.33's per-token weight versions on
/v1/completions, 0.17's older shapes; (2) faults a real server cannot be made
to have on cue: a pause, reload or cache reset that fails; (3) slowed decoding
to act mid-completion at an exact token.

It is not vLLM and serves no real model. It speaks the part of vLLM's HTTP
surface this project uses, so the launcher, supervisor and update protocol run
against a process that behaves the way vLLM's source says vLLM does.
Modelled on the wheels of vLLM 0.17.1 and 0.33.0 (read, not run); each
behaviour names the vLLM file it follows. `--version` (env
STANDIN_VLLM_VERSION, default 0.33.0) selects which of the two it mimics where
they differ: below 0.33 the 0.17.1 shapes, from 0.33 the 0.33.0 ones.

The "model" is a deterministic function: the next token's logits are a
seeded normal draw keyed by (weights digest, digest the KV was computed under,
context). So stale weights, stale KV and skipped post-load processing all show
up as different tokens, which is what the tests look for.

Test-only controls (not vLLM): STANDIN_TOKEN_DELAY_S slows decoding so a test
can act mid-completion; `POST /standin/faults` arms failures; `GET
/standin/state` reports what the engine holds.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import importlib
import json
import os
import random
import sys
import zlib
from collections.abc import AsyncIterator, Iterable
from pathlib import Path
from typing import Any

import numpy as np
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

DEFAULT_VERSION = "0.33.0"
RELAYOUT = 0x5DEECE66D  # the post-load "kernel layout" transform of a weights digest


def standin_version() -> str:
    return os.environ.get("STANDIN_VLLM_VERSION", DEFAULT_VERSION)


def _at_least_033() -> bool:
    major, minor = (int(x) for x in standin_version().split(".")[:2])
    return (major, minor) >= (0, 33)


def kv_cache_dtypes() -> tuple[str, ...]:
    """vllm/config/cache.py CacheDType (the fp8 family and, from 0.33, float16 and more)."""
    common = ("auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc", "fp8_ds_mla")
    return (*common, "float16", "nvfp4_ds_mla") if _at_least_033() else common


def tensors_digest(named: Iterable[tuple[str, Any]]) -> int:
    """A 63-bit digest of (name, tensor) pairs in name order, whatever the array type."""
    h = hashlib.sha256()
    for name, tensor in sorted(named, key=lambda item: item[0]):
        array = tensor.numpy() if hasattr(tensor, "numpy") else np.asarray(tensor)
        h.update(name.encode() + np.ascontiguousarray(array).tobytes())
    return int.from_bytes(h.digest()[:8], "little") >> 1


def checkpoint_tensors(weights_path: str | Path) -> list[tuple[str, np.ndarray]]:
    """Every tensor of every *.safetensors file (vllm/model_executor/model_loader: the loader's iterator)."""
    from safetensors import safe_open

    files = sorted(Path(weights_path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {weights_path}")
    out = []
    for file in files:
        with safe_open(str(file), framework="np") as handle:
            out += [(name, handle.get_tensor(name)) for name in handle.keys()]  # noqa: SIM118
    return out


class Model:
    """The weights as a kernel sees them. load_weights writes checkpoint-format
    values; process_weights_after_loading re-lays them out for the kernels
    (vllm/model_executor/model_loader/utils.py). Skipping the second step
    leaves wrong weights without an error, as on FlashInfer MoE or quantized models."""

    def __init__(self) -> None:
        self.params = 0

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        named = list(weights)
        self.params = tensors_digest(named)
        return {name for name, _ in named}

    def process_weights_after_loading(self) -> None:
        self.params ^= RELAYOUT


class Runner:
    """vllm/v1/worker/gpu_model_runner.py: reload_weights(weights_path=...) loads
    the checkpoint through the loader, then runs the post-load processing."""

    def __init__(self, model_path: str) -> None:
        self.model = Model()
        self.model_path = model_path
        self.fail_next_reload = 0

    def reload_weights(self, weights_path: str | None = None) -> None:
        path = weights_path or self.model_path
        tensors = checkpoint_tensors(path)
        if self.fail_next_reload:
            self.fail_next_reload -= 1
            self.model.load_weights(tensors[: len(tensors) // 2])  # died half-way through the copy
            raise RuntimeError(f"injected failure half-way through reloading {path}")
        self.model.load_weights(tensors)
        self.model.process_weights_after_loading()
        self.model_path = path  # vLLM points model_config.model at the new path


def make_worker(runner: Runner, extension_cls: str) -> Any:
    """vllm/v1/worker/worker_base.py: the --worker-extension-cls is mixed into
    the worker; collective_rpc calls methods on it by name."""

    class Worker:
        def __init__(self) -> None:
            self.model_runner = runner

        def reload_weights(self, *args: Any, **kwargs: Any) -> None:  # vllm/v1/worker/gpu_worker.py
            self.model_runner.reload_weights(*args, **kwargs)

    if not extension_cls:
        return Worker()
    module, _, name = extension_cls.rpartition(".")
    extension = getattr(importlib.import_module(module), name)
    return type("ExtendedWorker", (Worker, extension), {})()


class Seq:
    """One request in the scheduler (vllm/v1/request.py)."""

    def __init__(self, prompt: list[int], kv_params: int | None) -> None:
        self.prompt = prompt
        self.output: list[int] = []
        self.kv_params = kv_params  # the weights its KV was computed under; None: recompute
        self.aborted = False
        self.version_starts: list[tuple[str, int]] = []  # vllm/v1/engine/output_processor.py


class Engine:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.config = json.loads((Path(args.model) / "config.json").read_text())
        if args.max_model_len is None:
            args.max_model_len = int(self.config["max_position_embeddings"])
        self.vocab = int(self.config["vocab_size"])
        eos = self.config.get("eos_token_id")
        self.eos = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        self.runner = Runner(args.model)
        self.runner.reload_weights()  # start-up load, with processing
        self.worker = make_worker(self.runner, args.worker_extension_cls)
        # vllm/config/model.py: one global seed (default 0) drives unseeded requests.
        self.global_rng = random.Random(args.seed)
        self.running: set[Seq] = set()
        self.prefix_cache: dict[tuple[int, ...], int] = {}
        self.slots = asyncio.Semaphore(args.max_num_seqs)
        self.unpaused = asyncio.Event()
        self.unpaused.set()
        self.weight_version = "default"  # vllm/v1/engine/core.py
        self.faults = {"pause": 0, "reset": 0}
        self.delay = float(os.environ.get("STANDIN_TOKEN_DELAY_S", "0"))
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or args.model)

    # -- the model --------------------------------------------------------------
    def logits(self, seq: Seq) -> np.ndarray:
        context = np.asarray(seq.prompt + seq.output, dtype=np.int64)
        key = [self.runner.model.params, seq.kv_params or 0, zlib.crc32(context.tobytes())]
        return np.random.default_rng(key).standard_normal(self.vocab) * 2.0

    @staticmethod
    def log_softmax(x: np.ndarray) -> np.ndarray:
        shifted = x - x.max()
        return shifted - np.log(np.exp(shifted).sum())

    def processed(self, logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
        """--logprobs-mode processed_logprobs: after temperature, top-k and top-p (vllm/v1/sample/sampler.py)."""
        scaled = logits / temperature if temperature > 0 else logits
        if 0 < top_k < self.vocab:
            scaled = np.where(scaled >= np.sort(scaled)[-top_k], scaled, -np.inf)
        if top_p < 1.0:
            order = np.argsort(-scaled)
            probs = np.exp(self.log_softmax(scaled[order]))
            cut = np.searchsorted(np.cumsum(probs), top_p) + 1
            mask = np.full(self.vocab, -np.inf)
            mask[order[:cut]] = 0.0
            scaled = scaled + mask
        return self.log_softmax(scaled)

    # -- prefix cache and pause (vllm/v1/core/sched/scheduler.py, vllm/v1/engine/core.py) --
    def admit(self, prompt: list[int]) -> Seq:
        """A cached prefix keeps the KV (and so the weights) it was computed under."""
        key = tuple(prompt[:16])
        # vllm/config/cache.py: enable_prefix_caching None resolves to on for these models.
        caching = len(prompt) >= 16 and self.args.enable_prefix_caching is not False
        cached = self.prefix_cache.get(key) if caching else None
        seq = Seq(prompt, cached if cached is not None else self.runner.model.params)
        if caching:
            self.prefix_cache.setdefault(key, seq.kv_params or 0)
        return seq

    def reset_prefix_cache(self, reset_running_requests: bool) -> bool:
        """Fails while running requests hold KV blocks, unless they are preempted
        (reset_running_requests): they are then recomputed under the current weights."""
        if self.faults["reset"]:
            self.faults["reset"] -= 1
            return False
        if self.running and not reset_running_requests:
            return False
        for seq in self.running:
            seq.kv_params = None
        self.prefix_cache.clear()
        return True

    async def pause(self, mode: str) -> None:
        """abort: running requests end now; wait: they finish first; keep: they freeze."""
        self.unpaused.clear()
        if mode == "abort":
            for seq in self.running:
                seq.aborted = True
        elif mode == "wait":
            while self.running:
                await asyncio.sleep(0.01)

    # -- generation ---------------------------------------------------------------
    async def generate(
        self, prompt: list[int], body: dict[str, Any]
    ) -> AsyncIterator[tuple[Seq, int, float, str | None]]:
        """Yields (seq, token, processed logprob, finish reason or None) per sampled token."""
        await self.unpaused.wait()  # every pause mode queues new requests
        async with self.slots:
            seq = self.admit(prompt)
            self.running.add(seq)
            try:
                seed = body.get("seed")
                rng = random.Random(seed if seed is not None else self.global_rng.getrandbits(63))
                temperature = float(body.get("temperature", 1.0))
                top_k, top_p = int(body.get("top_k", -1) or -1), float(body.get("top_p", 1.0))
                stops = set(body.get("stop_token_ids") or [])
                for _ in range(int(body.get("max_tokens") or 16)):
                    if self.delay:
                        await asyncio.sleep(self.delay)
                    while not (self.unpaused.is_set() or seq.aborted):  # keep: frozen in place
                        await asyncio.sleep(0.005)
                    if seq.aborted:
                        yield seq, -1, 0.0, "abort"
                        return
                    if seq.kv_params is None:  # preempted: recomputed under the current weights
                        seq.kv_params = self.runner.model.params
                    logprobs = self.processed(self.logits(seq), temperature, top_k, top_p)
                    if temperature == 0:
                        token = int(np.argmax(logprobs))
                    else:
                        token = int(rng.choices(range(self.vocab), weights=np.exp(logprobs).tolist())[0])
                    if not seq.version_starts or seq.version_starts[-1][0] != self.weight_version:
                        seq.version_starts.append((self.weight_version, len(seq.output)))
                    seq.output.append(token)
                    done = len(seq.output) == int(body.get("max_tokens") or 16)
                    if token in stops or (token in self.eos and not body.get("ignore_eos")):
                        yield seq, token, float(logprobs[token]), "stop"
                        return
                    yield seq, token, float(logprobs[token]), "length" if done else None
            finally:
                self.running.discard(seq)

    def prompt_logprobs(self, prompt: list[int]) -> list[dict[str, Any] | None]:
        """At temperature 1 whatever the request's temperature (vllm/v1/worker/gpu_model_runner.py
        _get_prompt_logprobs_dict: raw logits, no sampling parameters applied)."""
        out: list[dict[str, Any] | None] = [None]
        for i in range(1, len(prompt)):
            seq = Seq(prompt[:i], self.runner.model.params)
            lp = float(self.log_softmax(self.logits(seq))[prompt[i]])
            out.append({str(prompt[i]): {"logprob": lp, "rank": 1, "decoded_token": self.token_str(prompt[i])}})
        return out

    def token_str(self, token: int) -> str:
        if self.args.return_tokens_as_token_ids:
            return f"token_id:{token}"
        return str(self.tokenizer.decode([token]))


def error(status: int, message: str, param: str | None = None) -> JSONResponse:
    """vllm/entrypoints/openai/engine/protocol.py ErrorResponse."""
    kind = "BadRequestError" if status == 400 else "InternalServerError"
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}}, status)


def build_app(engine: Engine) -> Starlette:
    args = engine.args

    async def completions(request: Request) -> Response:
        """vllm/entrypoints/openai/completion/serving.py."""
        body = await request.json()
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            prompt = engine.tokenizer.encode(prompt) if prompt else []
        if not prompt:
            return error(400, "prompt must not be empty", "prompt")
        max_tokens = int(body.get("max_tokens") or 16)
        if len(prompt) + max_tokens > args.max_model_len:
            return error(
                400,
                f"This model's maximum context length is {args.max_model_len} tokens. However, "
                f"you requested {len(prompt) + max_tokens} tokens.",
            )
        if body.get("stream"):
            return StreamingResponse(_stream(engine, prompt, body), media_type="text/event-stream")
        steps = [step async for step in engine.generate(prompt, body)]
        sampled = [(token, logprob) for _, token, logprob, _ in steps if token >= 0]
        tokens, logprobs = [t for t, _ in sampled], [lp for _, lp in sampled]
        seq, finish = (steps[-1][0], steps[-1][3]) if steps else (None, None)
        choice = _choice(engine, body, prompt, tokens, logprobs, finish, seq)
        if body.get("prompt_logprobs") is not None:
            choice["prompt_logprobs"] = engine.prompt_logprobs(prompt)
        usage = {
            "prompt_tokens": len(prompt),
            "completion_tokens": len(tokens),
            "total_tokens": len(prompt) + len(tokens),
        }
        return JSONResponse(
            {
                "id": "cmpl-standin",
                "object": "text_completion",
                "model": args.served_model_name,
                "choices": [choice],
                "usage": usage,
            }
        )

    async def pause(request: Request) -> Response:
        """vllm/entrypoints/serve/rlhf/api_router.py (0.17.1), rl/online/api_router.py (0.33.0)."""
        mode = request.query_params.get("mode", "abort")
        if mode not in ("abort", "wait", "keep"):
            return JSONResponse({"error": f"Invalid pause mode: {mode}"}, 400)
        await engine.pause(mode)
        if engine.faults["pause"]:
            engine.faults["pause"] -= 1  # paused, but the caller hears a failure
            return JSONResponse({"error": "Failed to pause generation: injected"}, 500)
        return JSONResponse({"status": "paused"})

    async def resume(request: Request) -> Response:
        engine.unpaused.set()
        return JSONResponse({"status": "resumed"})

    async def is_paused(request: Request) -> Response:
        return JSONResponse({"is_paused": not engine.unpaused.is_set()})

    async def reset_prefix_cache(request: Request) -> Response:
        """0.17.1 answers an empty 200 whatever happened (serve/cache/api_router.py);
        0.33.0 answers {"success": bool} (serve/dev/cache/api_router.py)."""
        running = request.query_params.get("reset_running_requests", "false").lower() == "true"
        success = engine.reset_prefix_cache(running)
        return JSONResponse({"success": success}) if _at_least_033() else Response(status_code=200)

    async def collective_rpc(request: Request) -> Response:
        """vllm/entrypoints/serve/rpc/api_router.py: calls the method on every worker."""
        body = await request.json()
        method = getattr(engine.worker, str(body.get("method")), None)
        if method is None:
            return error(500, f"worker has no method {body.get('method')!r}")
        try:
            result = method(*body.get("args", []), **body.get("kwargs", {}))
        except Exception as exc:  # vLLM surfaces a worker's exception as a 500
            return error(500, f"{type(exc).__name__}: {exc}")
        return JSONResponse({"results": [result if result is None or isinstance(result, dict | list) else str(result)]})

    async def update_weight_version(request: Request) -> Response:
        """0.33.0 only (rl/online/api_router.py): labels the weights without loading any."""
        if not _at_least_033():
            return JSONResponse({"detail": "Not Found"}, 404)
        engine.weight_version = str((await request.json())["new_version"])
        return JSONResponse({"success": True, "new_version": engine.weight_version})

    async def models(request: Request) -> Response:
        card = {
            "id": args.served_model_name,
            "object": "model",
            "root": engine.runner.model_path,
            "max_model_len": args.max_model_len,
        }
        return JSONResponse({"object": "list", "data": [card]})

    async def tokenize(request: Request) -> Response:
        body = await request.json()
        if body.get("messages") is not None:
            ids = engine.tokenizer.apply_chat_template(
                body["messages"],
                add_generation_prompt=body.get("add_generation_prompt", True),
                tokenize=True,
                return_dict=False,
            )
        else:
            ids = engine.tokenizer.encode(
                body.get("prompt", ""), add_special_tokens=body.get("add_special_tokens", True)
            )
        return JSONResponse({"count": len(ids), "max_model_len": args.max_model_len, "tokens": list(ids)})

    async def detokenize(request: Request) -> Response:
        return JSONResponse({"prompt": engine.tokenizer.decode((await request.json())["tokens"])})

    async def faults(request: Request) -> Response:
        body = await request.json()
        engine.faults["pause"] += int(body.get("pause", 0))
        engine.faults["reset"] += int(body.get("reset", 0))
        engine.runner.fail_next_reload += int(body.get("reload", 0))
        return JSONResponse({"armed": True})

    async def state(request: Request) -> Response:
        live = engine.runner.model.params
        return JSONResponse(
            {
                "params": live,
                "weights_path": engine.runner.model_path,
                "weight_version": engine.weight_version,
                "seed": args.seed,
                "options": {
                    name: getattr(args, name)
                    for name in ("dtype", "kv_cache_dtype", "kv_cache_memory_bytes", "enable_prefix_caching")
                },
                "running": len(engine.running),
                "stale_kv_requests": sum(1 for s in engine.running if s.kv_params not in (None, live)),
                "stale_cached_prefixes": sum(1 for p in engine.prefix_cache.values() if p != live),
            }
        )

    async def health(request: Request) -> Response:
        return Response(status_code=200)

    routes = [
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/models", models),
        Route("/health", health),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/standin/faults", faults, methods=["POST"]),
        Route("/standin/state", state),
    ]
    if os.environ.get("VLLM_SERVER_DEV_MODE") == "1":  # the dev routers attach only in dev mode
        routes += [
            Route("/pause", pause, methods=["POST"]),
            Route("/resume", resume, methods=["POST"]),
            Route("/is_paused", is_paused),
            Route("/reset_prefix_cache", reset_prefix_cache, methods=["POST"]),
            Route("/collective_rpc", collective_rpc, methods=["POST"]),
            Route("/update_weight_version", update_weight_version, methods=["POST"]),
        ]
    return Starlette(routes=routes)


def _choice(
    engine: Engine,
    body: dict[str, Any],
    prompt: list[int],
    tokens: list[int],
    logprobs: list[float],
    finish: str | None,
    seq: Seq | None,
) -> dict[str, Any]:
    choice: dict[str, Any] = {
        "index": 0,
        "text": engine.tokenizer.decode(tokens),
        "finish_reason": finish,
        "stop_reason": tokens[-1] if finish == "stop" and tokens and tokens[-1] not in engine.eos else None,
        "token_ids": tokens,
        "prompt_token_ids": prompt,
    }
    if body.get("logprobs") is not None:
        choice["logprobs"] = {
            "tokens": [engine.token_str(t) for t in tokens],
            "token_logprobs": logprobs,
            "top_logprobs": _top(engine, body, seq, tokens),
        }
    if body.get("return_weight_versions") and seq is not None and _at_least_033():
        starts = seq.version_starts + [("", len(seq.output))]
        choice["weight_versions"] = [
            {"version": v, "start": a, "end": b} for (v, a), (_, b) in zip(starts, starts[1:], strict=False)
        ]
    return choice


def _top(engine: Engine, body: dict[str, Any], seq: Seq | None, tokens: list[int]) -> list[dict[str, float]] | None:
    """Top-k processed logprobs of the first position only (all the tests read)."""
    k = int(body.get("logprobs") or 0)
    if not k or seq is None or not tokens:
        return None
    first = Seq(seq.prompt, engine.runner.model.params)
    lp = engine.processed(engine.logits(first), float(body.get("temperature", 1.0)), -1, 1.0)
    return [{engine.token_str(int(t)): float(lp[t]) for t in np.argsort(-lp)[:k]}] + [{}] * (len(tokens) - 1)


async def _stream(engine: Engine, prompt: list[int], body: dict[str, Any]) -> AsyncIterator[bytes]:
    async for seq, token, logprob, finish in engine.generate(prompt, body):
        tokens = [token] if token >= 0 else []
        choice = _choice(
            engine, {**body, "return_weight_versions": False}, prompt, tokens, [logprob] * len(tokens), finish, seq
        )
        if finish is not None and body.get("return_weight_versions"):  # only the last chunk carries them
            choice["weight_versions"] = _choice(engine, body, prompt, seq.output, [], finish, seq).get(
                "weight_versions"
            )
        yield f"data: {json.dumps({'choices': [choice]})}\n\n".encode()
    yield b"data: [DONE]\n\n"


def main(argv: list[str]) -> int:
    """vllm/entrypoints/cli/main.py: `--version` prints the version; `serve MODEL` serves."""
    if argv[:1] in (["--version"], ["-v"]):
        print(standin_version())
        return 0
    parser = argparse.ArgumentParser(prog="vllm")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve")
    serve.add_argument("model")
    serve.add_argument("--host", required=True)
    serve.add_argument("--port", type=int, required=True)
    serve.add_argument("--served-model-name", required=True)
    serve.add_argument("--tokenizer", default=None)
    # As vLLM: without it the model's own context (config.json's max_position_embeddings).
    serve.add_argument("--max-model-len", type=int)
    serve.add_argument("--max-num-seqs", type=int, required=True)
    serve.add_argument("--seed", type=int, default=0)
    serve.add_argument(
        "--logprobs-mode", choices=("raw_logprobs", "processed_logprobs", "raw_logits", "processed_logits")
    )
    serve.add_argument("--return-tokens-as-token-ids", action="store_true")
    serve.add_argument("--generation-config", default="auto")
    serve.add_argument("--worker-extension-cls", default="")
    # vllm/engine/arg_utils.py (add_cli_args) with the choices of vllm/config/model.py and cache.py.
    serve.add_argument("--dtype", choices=("auto", "half", "float16", "bfloat16", "float", "float32"), default="auto")
    serve.add_argument("--kv-cache-dtype", choices=kv_cache_dtypes(), default="auto")
    serve.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    serve.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None)
    args = parser.parse_args(argv)
    if args.logprobs_mode != "processed_logprobs":
        parser.error("this stand-in only reports processed logprobs")
    if not (Path(args.model) / "config.json").is_file():
        print(f"stand-in vllm: no config.json in {args.model}", file=sys.stderr)
        return 1
    import uvicorn

    engine = Engine(args)
    uvicorn.run(build_app(engine), host=args.host, port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
