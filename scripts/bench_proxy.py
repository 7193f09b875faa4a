#!/usr/bin/env python
"""Benchmark: latency the token-capture proxy adds to a model call.

In one run: an instant-reply engine (the scripted test engine instrument) in
its own process, the proxy in another, and this process as the harness. Both
servers run under uvicorn with the same settings (uvloop and httptools when
installed, no access log, start-up objects frozen out of the garbage
collector's reach as `legorl proxy` does); the harness uses one keep-alive
client for every path. Each session plays a multi-turn tool loop (the conversation grows,
earlier turns come back re-serialised) through the proxy's chat-completions
route; the same prompts are then sent straight to the engine's
`/v1/completions`. Proxy and direct phases alternate (`--rounds`) so load
drift on a shared machine hits both. Reported per concurrency level: p50/p99
per-call latency both ways and their difference (the added latency), calls/s,
and the proxy's own time per call from its trajectory records.

With `--litellm`, LiteLLM's proxy runs beside it as a plain pass-through
(`hosted_vllm/` provider, `api_base` = the same engine, which answers its
`/v1/chat/completions` instantly): the same sessions go through LiteLLM, the
same chat bodies straight to the engine, and the added latencies are compared.
LiteLLM lives in its own virtualenv (`--litellm-venv`, created with
`pip install 'litellm[proxy]'` on first use; it pulls many packages), never in
the project's.

    .venv/bin/python scripts/bench_proxy.py [--sessions 1 64] [--turns 8] [--litellm] [--profile FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import importlib.util
import json
import multiprocessing as mp
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

ADMIN = "bench-admin"
TOOL = {
    "type": "function",
    "function": {
        "name": "bash",
        "description": "Run a shell command.",
        "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]},
    },
}
REPLY = (
    "<think>\nlook at the files\n</think>\n\nChecking.\n<tool_call>\n"
    '{"name": "bash", "arguments": {"command": "ls -la src"}}\n</tool_call>'
)
# The same turn as a chat message, for pass-through proxies that call the engine's chat route.
CHAT_REPLY = {
    "role": "assistant",
    "content": "Checking.",
    "tool_calls": [
        {"id": "call_0", "type": "function", "function": {"name": "bash", "arguments": '{"command": "ls -la src"}'}}
    ],
}
LITELLM_VENV = REPO / ".cache" / "litellm-venv"
LITELLM_KEY = "sk-bench-" + secrets.token_hex(16)


def _tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _serve(app: Any, ports: Any, profile: str | None = None) -> None:
    """Runs `app` under uvicorn in this process's main thread, on a free port
    it reports on `ports`; with `profile`, under cProfile until SIGTERM."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(
        app,
        log_level="warning",
        access_log=False,
        lifespan="on",
        loop="uvloop" if importlib.util.find_spec("uvloop") else "asyncio",
        http="httptools" if importlib.util.find_spec("httptools") else "h11",
    )
    ports.put(f"http://127.0.0.1:{sock.getsockname()[1]}")
    server = uvicorn.Server(config)
    if profile is not None:
        import cProfile
        import pstats
        import signal

        # CPU time, not wall time: on shared cores a wall-clock profile charges
        # whichever call is running (a socket write that wakes the engine) for
        # the time the other processes preempt it.
        profiler = cProfile.Profile(time.process_time)

        def stop(*_: Any) -> None:
            # uvicorn re-raises the SIGTERM it shut down on, once its old handler (this one) is back.
            profiler.disable()
            profiler.dump_stats(profile)
            pstats.Stats(profile).sort_stats("tottime").print_stats(25)
            sys.exit(0)

        signal.signal(signal.SIGTERM, stop)
        profiler.enable()
    gc.freeze()  # as `legorl proxy` and `legorl rollout-server` do once started
    server.run(sockets=[sock])


def _serve_engine(tokenizer_dir: str, ports: Any) -> None:
    from tests.proxy.scripted_engine import ScriptedEngine

    engine = ScriptedEngine(_tokenizer(tokenizer_dir), default=REPLY)
    engine.chat_message = CHAT_REPLY
    _serve(engine.app, ports)


def _serve_proxy(tokenizer_dir: str, engine_url: str, ports: Any, profile: str | None) -> None:
    from legorl_jax.core.config import SessionCaps
    from rollout_server.proxy.app import build_app
    from rollout_server.proxy.engine_client import ProxyEngineClient
    from rollout_server.proxy.render import ChatTemplate
    from rollout_server.proxy.service import ProxyCore
    from rollout_server.proxy.session import SessionStore

    store = SessionStore(SessionCaps(max_model_calls=10**6, max_total_tokens=10**9, max_wall_s=10**6))
    core = ProxyCore(
        ChatTemplate(_tokenizer(tokenizer_dir)), ProxyEngineClient(engine_url, "bench"), store, max_context=32768
    )
    _serve(build_app(core, admin_token=ADMIN), ports, profile)


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system) a process has used: unlike latency, barely
    moved by other load on a shared machine."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _messages() -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": "You are a coding agent. " * 40},
        {"role": "user", "content": "Find the failing test and fix it."},
    ]


async def _tool_loop(
    http: Any, url: str, headers: dict[str, str], turns: int, out: list[float], bodies: list[dict[str, Any]]
) -> None:
    """One session: a tool loop of `turns` chat calls, each timed; the bodies sent are kept."""
    messages = _messages()
    for turn in range(turns):
        body = {"model": "policy", "messages": list(messages), "tools": [TOOL]}
        start = time.perf_counter()
        reply = await http.post(f"{url}/chat/completions", headers=headers, json=body)
        out.append(time.perf_counter() - start)
        if reply.status_code != 200:
            raise RuntimeError(f"{url}: {reply.status_code} {reply.text[:300]}")
        bodies.append(body)
        call = reply.json()["choices"][0]["message"]["tool_calls"][0]
        messages += [  # sent back compactly re-serialised, as OpenCode does
            {
                "role": "assistant",
                "content": "Checking.",
                "tool_calls": [
                    {
                        "id": call["id"],
                        "type": "function",
                        "function": {
                            "name": "bash",
                            "arguments": json.dumps(json.loads(call["function"]["arguments"]), separators=(",", ":")),
                        },
                    }
                ],
            },
            {"role": "tool", "tool_call_id": call["id"], "content": f"file_{turn}.py\n" * 20},
        ]


async def _replay(http: Any, url: str, bodies: list[dict[str, Any]], out: list[float]) -> None:
    for body in bodies:
        start = time.perf_counter()
        reply = await http.post(url, json=body)
        out.append(time.perf_counter() - start)
        if reply.status_code != 200:
            raise RuntimeError(f"{url}: {reply.status_code} {reply.text[:300]}")


class _Tally:
    """Per path: call latencies, wall time of the phases, and the serving
    process's CPU time during them (not during trajectory fetches)."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self.latencies: dict[str, list[float]] = {"ours": [], "direct": [], "litellm": [], "direct_chat": []}
        self.wall = dict.fromkeys(self.latencies, 0.0)
        self.cpu = dict.fromkeys(pids, 0.0)

    async def phase(
        self, name: str, sessions: int, concurrency: int, run: Callable[[int, list[float]], Awaitable[Any]]
    ) -> list[Any]:
        """Runs `sessions` sessions, at most `concurrency` at once; returns their results."""
        gate = asyncio.Semaphore(concurrency)

        async def gated(i: int) -> Any:
            async with gate:
                return await run(i, self.latencies[name])

        pid = self.pids.get(name)
        cpu = _cpu_s(pid) if pid else 0.0
        start = time.perf_counter()
        results = await asyncio.gather(*(gated(i) for i in range(sessions)))
        self.wall[name] += time.perf_counter() - start
        if pid:
            self.cpu[name] += _cpu_s(pid) - cpu
        return list(results)


async def _ours(
    http: Any, proxy: str, engine: str, sessions: int, concurrency: int, turns: int, tally: _Tally
) -> list[dict[str, Any]]:
    from rollout_server.backends.client import completion_body

    admin = {"authorization": f"Bearer {ADMIN}"}
    made = [(await http.post(f"{proxy}/admin/sessions", json={}, headers=admin)).json() for _ in range(sessions)]
    await tally.phase(
        "ours",
        sessions,
        concurrency,
        lambda i, out: _tool_loop(
            http, made[i]["urls"]["openai"], {"authorization": f"Bearer {made[i]['key']}"}, turns, out, []
        ),
    )
    trajectories = [
        (await http.get(f"{proxy}/admin/sessions/{m['key']}/trajectory", headers=admin)).json() for m in made
    ]
    # The same prompts, straight to the engine, with the same concurrency, in the body the
    # proxy's engine client builds (minus the session's sampling).
    prompts = [
        [completion_body(p, "bench", max_tokens=1024, return_tokens_as_token_ids=True) for p in _prompts(t)]
        for t in trajectories
    ]
    await tally.phase(
        "direct", sessions, concurrency, lambda i, out: _replay(http, f"{engine}/v1/completions", prompts[i], out)
    )
    return trajectories


async def _litellm(
    http: Any, litellm: str, engine: str, sessions: int, concurrency: int, turns: int, tally: _Tally
) -> None:
    bodies: list[list[dict[str, Any]]] = [[] for _ in range(sessions)]
    key = {"authorization": f"Bearer {LITELLM_KEY}"}
    await tally.phase(
        "litellm", sessions, concurrency, lambda i, out: _tool_loop(http, f"{litellm}/v1", key, turns, out, bodies[i])
    )
    await tally.phase(
        "direct_chat",
        sessions,
        concurrency,
        lambda i, out: _replay(
            http, f"{engine}/v1/chat/completions", [{**b, "model": "bench"} for b in bodies[i]], out
        ),
    )


async def _level(
    proxy: str,
    engine: str,
    litellm: str | None,
    concurrency: int,
    turns: int,
    min_calls: int,
    rounds: int,
    pids: dict[str, int],
) -> dict[str, Any]:
    import httpx

    tally = _Tally(pids)
    sessions = max(concurrency, -(-min_calls // (turns * rounds)))
    # One client, one keep-alive pool for every path; idle connections expire
    # before the servers' 5 s keep-alive timeout closes them under us.
    limits = httpx.Limits(
        max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4, keepalive_expiry=2.0
    )
    trajectories: list[dict[str, Any]] = []
    async with httpx.AsyncClient(timeout=300, limits=limits) as http:
        for _ in range(rounds):
            trajectories += await _ours(http, proxy, engine, sessions, concurrency, turns, tally)
            if litellm:
                await _litellm(http, litellm, engine, sessions, concurrency, turns, tally)
    out, walls = tally.latencies, tally.wall
    own = [c["latency_s"] - c["engine_latency_s"] for t in trajectories for c in t["calls"]]
    row: dict[str, Any] = {"sessions": concurrency, "calls": len(out["ours"])}
    for name, seconds in tally.cpu.items():
        row[f"{name}_cpu_ms_per_call"] = 1e3 * seconds / max(len(out[name]), 1)
    for name, values in out.items():
        if values:
            row[f"{name}_p50_ms"] = 1e3 * _percentile(values, 0.5)
            row[f"{name}_p99_ms"] = 1e3 * _percentile(values, 0.99)
            row[f"{name}_calls_per_s"] = len(values) / walls[name]
    for name, base in (("ours", "direct"), ("litellm", "direct_chat")):
        if out[name]:
            for q in ("p50", "p99"):
                row[f"{name}_added_{q}_ms"] = row[f"{name}_{q}_ms"] - row[f"{base}_{q}_ms"]
    if litellm:
        for q in ("p50", "p99"):  # how many times more latency LiteLLM adds than ours
            row[f"litellm_vs_ours_added_{q}"] = row[f"litellm_added_{q}_ms"] / max(row[f"ours_added_{q}_ms"], 1e-3)
    row["in_proxy_p50_ms"] = 1e3 * _percentile(own, 0.5)
    row["in_proxy_p99_ms"] = 1e3 * _percentile(own, 0.99)
    row["incremental_render_share"] = sum(
        c.get("incremental_render", False) for t in trajectories for c in t["calls"]
    ) / len(own)
    row["merged_ratio_mean"] = sum(t["metrics"]["merged_ratio"] for t in trajectories) / len(trajectories)
    return row


def _prompts(trajectory: dict[str, Any]) -> list[list[int]]:
    """Each call's prompt ids: a call's prompt is always the start of its sequence."""
    return [trajectory["sequences"][c["sequence"]]["token_ids"][: c["prompt_tokens"]] for c in trajectory["calls"]]


def _litellm_venv(venv: Path) -> Path:
    """LiteLLM's CLI, installed into its own virtualenv on first use."""
    cli = venv / "bin" / "litellm"
    if cli.exists():
        return cli
    print(
        f"bench: installing litellm[proxy] into {venv} (first use only; a few minutes) ...", file=sys.stderr, flush=True
    )
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(venv / "bin" / "pip"), "install", "--quiet", "litellm[proxy]"], check=True)
    print("bench: litellm installed", file=sys.stderr, flush=True)
    return cli


def _start_litellm(venv: Path, engine_url: str, workdir: Path) -> tuple[subprocess.Popen[bytes], str]:
    """LiteLLM's proxy as a plain pass-through to the engine; returns it and its URL once it answers."""
    import httpx

    cli = _litellm_venv(venv)
    config = workdir / "litellm.yaml"
    config.write_text(
        json.dumps(
            {  # JSON is YAML
                "model_list": [
                    {
                        "model_name": "policy",
                        "litellm_params": {
                            "model": "hosted_vllm/bench",
                            "api_base": f"{engine_url}/v1",
                            "api_key": "none",
                        },
                    }
                ],
                "litellm_settings": {"drop_params": True, "telemetry": False},
                # LiteLLM refuses to start as an open relay; ours checks a session key too.
                "general_settings": {"master_key": LITELLM_KEY},
            }
        )
    )
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_LOG": "ERROR", "LITELLM_TELEMETRY": "False"}
    log = (workdir / "litellm.log").open("wb")
    proc = subprocess.Popen(
        [str(cli), "--config", str(config), "--host", "127.0.0.1", "--port", str(port), "--num_workers", "1"],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"litellm exited with {proc.returncode}; see {workdir / 'litellm.log'}")
        try:
            if httpx.get(f"{url}/health/liveliness", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.terminate()
    raise RuntimeError(f"litellm did not answer within 300 s; see {workdir / 'litellm.log'}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, nargs="+", default=[1, 64], help="concurrency levels")
    parser.add_argument("--turns", type=int, default=8, help="model calls per session")
    parser.add_argument("--min-calls", type=int, default=256, help="calls per path and level, at least")
    parser.add_argument("--rounds", type=int, default=2, help="alternations of the proxy and direct phases")
    parser.add_argument("--litellm", action="store_true", help="also run LiteLLM's proxy as a pass-through")
    parser.add_argument("--litellm-venv", type=Path, default=LITELLM_VENV, help="LiteLLM's own virtualenv")
    parser.add_argument("--profile", help="write a CPU-time cProfile of the proxy process here (and print its top)")
    args = parser.parse_args()
    if importlib.util.find_spec("uvloop"):
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    from legorl_jax.models.tokenizer import build_demo_tokenizer

    workdir = Path(tempfile.mkdtemp(prefix="bench-proxy-"))
    tokenizer_dir = str(build_demo_tokenizer(workdir / "tokenizer"))
    ctx = mp.get_context("spawn")
    ports = ctx.Queue()
    engine_proc = ctx.Process(target=_serve_engine, args=(tokenizer_dir, ports), daemon=True)
    engine_proc.start()
    engine_url = ports.get(timeout=120)
    proxy_proc = ctx.Process(target=_serve_proxy, args=(tokenizer_dir, engine_url, ports, args.profile))
    proxy_proc.start()
    proxy_url = ports.get(timeout=120)
    litellm_proc, litellm_url = _start_litellm(args.litellm_venv, engine_url, workdir) if args.litellm else (None, None)
    assert proxy_proc.pid is not None  # set by start()
    pids = {"ours": proxy_proc.pid, **({"litellm": litellm_proc.pid} if litellm_proc else {})}
    try:
        asyncio.run(_level(proxy_url, engine_url, litellm_url, 1, 2, 4, 1, pids))  # warm-up: imports, pools
        for sessions in args.sessions:
            row = asyncio.run(
                _level(proxy_url, engine_url, litellm_url, sessions, args.turns, args.min_calls, args.rounds, pids)
            )
            print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    finally:
        if litellm_proc is not None:
            litellm_proc.terminate()
            litellm_proc.wait(timeout=30)
        proxy_proc.terminate()  # SIGTERM: uvicorn shuts down, and a profile is written
        proxy_proc.join(timeout=60)
        engine_proc.terminate()
    return 0


if __name__ == "__main__":
    sys.exit(main())
