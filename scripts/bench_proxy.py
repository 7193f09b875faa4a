#!/usr/bin/env python
"""Benchmark: latency the token-capture proxy adds to a model call.

In one run: an instant-reply engine (the scripted test engine) in its own
process, the proxy in another, and this process as the harness. Each session
plays a multi-turn tool loop (the conversation grows, earlier turns come back
re-serialised) through the proxy's chat-completions route; the same prompts
are also sent straight to the engine's `/v1/completions`. Reported per
concurrency level: p50/p99 per-call latency both ways and their difference
(the added latency), calls/s, and the proxy's own time per call from its
trajectory records (end-to-end minus engine time).

    .venv/bin/python scripts/bench_proxy.py [--sessions 1 64] [--turns 8]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

ADMIN = "bench-admin"
TOOL = {"type": "function", "function": {"name": "bash", "description": "Run a shell command.", "parameters": {
    "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}
REPLY = ('<think>\nlook at the files\n</think>\n\nChecking.\n<tool_call>\n'
         '{"name": "bash", "arguments": {"command": "ls -la src"}}\n</tool_call>')


def _tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _serve_engine(tokenizer_dir: str, ports: Any) -> None:
    from tests.proxy.scripted_engine import ScriptedEngine, ServerThread

    engine = ScriptedEngine(_tokenizer(tokenizer_dir), default=REPLY)
    with ServerThread(engine.app) as server:
        ports.put(server.url)
        while True:
            time.sleep(3600)


def _serve_proxy(tokenizer_dir: str, engine_url: str, ports: Any) -> None:
    from rollout_server.proxy.app import build_app
    from rollout_server.proxy.engine_client import EngineClient
    from rollout_server.proxy.render import ChatTemplate
    from rollout_server.proxy.service import ProxyCore
    from rollout_server.proxy.session import SessionCaps, SessionStore
    from tests.proxy.scripted_engine import ServerThread

    store = SessionStore(SessionCaps(max_model_calls=10**6, max_total_tokens=10**9, max_wall_s=10**6))
    core = ProxyCore(ChatTemplate(_tokenizer(tokenizer_dir)), EngineClient(engine_url, "bench"), store,
                     max_context=32768)
    with ServerThread(build_app(core, admin_token=ADMIN)) as server:
        ports.put(server.url)
        while True:
            time.sleep(3600)


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _session(http: Any, proxy: str, turns: int, out: dict[str, list[float]]) -> str:
    made = (await http.post(f"{proxy}/admin/sessions", json={}, headers={"authorization": f"Bearer {ADMIN}"})).json()
    key = made["key"]
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a coding agent. " * 40},
                                      {"role": "user", "content": "Find the failing test and fix it."}]
    for turn in range(turns):
        start = time.perf_counter()
        reply = await http.post(f"{made['urls']['openai']}/chat/completions", headers={"authorization": f"Bearer {key}"},
                                json={"model": "m", "messages": messages, "tools": [TOOL]})
        out["proxy"].append(time.perf_counter() - start)
        call = reply.json()["choices"][0]["message"]["tool_calls"][0]
        messages += [  # sent back compactly re-serialised, as OpenCode does
            {"role": "assistant", "content": "Checking.", "tool_calls": [
                {"id": call["id"], "type": "function",
                 "function": {"name": "bash", "arguments": json.dumps(json.loads(call["function"]["arguments"]),
                                                                      separators=(",", ":"))}}]},
            {"role": "tool", "tool_call_id": call["id"], "content": f"file_{turn}.py\n" * 20},
        ]
    return key


async def _direct(http: Any, engine: str, prompts: list[list[int]], out: dict[str, list[float]]) -> None:
    for prompt in prompts:
        start = time.perf_counter()
        await http.post(f"{engine}/v1/completions", json={
            "model": "bench", "prompt": prompt, "max_tokens": 1024, "logprobs": 1, "return_token_ids": True,
            "temperature": 1.0, "top_p": 1.0, "top_k": -1})
        out["direct"].append(time.perf_counter() - start)


async def _level(proxy: str, engine: str, sessions: int, turns: int) -> dict[str, Any]:
    import httpx

    out: dict[str, list[float]] = {"proxy": [], "direct": []}
    # Idle connections expire before the servers' 5 s keep-alive timeout closes them under us.
    limits = httpx.Limits(max_connections=sessions + 4, max_keepalive_connections=sessions + 4, keepalive_expiry=2.0)
    async with httpx.AsyncClient(timeout=120, limits=limits) as http:
        start = time.perf_counter()
        keys = await asyncio.gather(*(_session(http, proxy, turns, out) for _ in range(sessions)))
        proxy_wall = time.perf_counter() - start
        trajectories = [(await http.get(f"{proxy}/admin/sessions/{k}/trajectory",
                                        headers={"authorization": f"Bearer {ADMIN}"})).json() for k in keys]
        # The same prompts, straight to the engine, with the same concurrency.
        prompts = [_prompts(t) for t in trajectories]
        start = time.perf_counter()
        await asyncio.gather(*(_direct(http, engine, p, out) for p in prompts))
        direct_wall = time.perf_counter() - start
    own = [c["latency_s"] - c["engine_latency_s"] for t in trajectories for c in t["calls"]]
    merged = [t["metrics"]["merged_ratio"] for t in trajectories]
    return {
        "sessions": sessions, "calls": len(out["proxy"]),
        "proxy_p50_ms": 1e3 * _percentile(out["proxy"], 0.5), "proxy_p99_ms": 1e3 * _percentile(out["proxy"], 0.99),
        "direct_p50_ms": 1e3 * _percentile(out["direct"], 0.5), "direct_p99_ms": 1e3 * _percentile(out["direct"], 0.99),
        "added_p50_ms": 1e3 * (_percentile(out["proxy"], 0.5) - _percentile(out["direct"], 0.5)),
        "added_p99_ms": 1e3 * (_percentile(out["proxy"], 0.99) - _percentile(out["direct"], 0.99)),
        "in_proxy_p50_ms": 1e3 * _percentile(own, 0.5), "in_proxy_p99_ms": 1e3 * _percentile(own, 0.99),
        "proxy_calls_per_s": len(out["proxy"]) / proxy_wall, "direct_calls_per_s": len(out["direct"]) / direct_wall,
        "merged_ratio_mean": statistics.fmean(merged),
    }


def _prompts(trajectory: dict[str, Any]) -> list[list[int]]:
    """Each call's prompt ids: a call's prompt is always the start of its sequence."""
    return [trajectory["sequences"][c["sequence"]]["token_ids"][: c["prompt_tokens"]] for c in trajectory["calls"]]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, nargs="+", default=[1, 64], help="concurrency levels")
    parser.add_argument("--turns", type=int, default=8, help="model calls per session")
    args = parser.parse_args()
    from legorl_jax.models.tokenizer import build_demo_tokenizer

    tokenizer_dir = str(build_demo_tokenizer(tempfile.mkdtemp(prefix="bench-tokenizer-")))
    ctx = mp.get_context("spawn")
    ports = ctx.Queue()
    engine_proc = ctx.Process(target=_serve_engine, args=(tokenizer_dir, ports), daemon=True)
    engine_proc.start()
    engine_url = ports.get(timeout=120)
    proxy_proc = ctx.Process(target=_serve_proxy, args=(tokenizer_dir, engine_url, ports), daemon=True)
    proxy_proc.start()
    proxy_url = ports.get(timeout=120)
    try:
        asyncio.run(_level(proxy_url, engine_url, 1, 2))  # warm-up: imports, connection pools
        for sessions in args.sessions:
            row = asyncio.run(_level(proxy_url, engine_url, sessions, args.turns))
            print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    finally:
        proxy_proc.terminate()
        engine_proc.terminate()
    return 0


if __name__ == "__main__":
    sys.exit(main())
