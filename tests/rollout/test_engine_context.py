"""The rollout server and its engine: the embedded engine it launches gets the
engine section's KV options, and the context its proxy holds prompts to is the
one the engine serves (`/v1/models` max_model_len), read from an external
engine even when that engine comes up after the server, never the config's
max_context. Local sandboxes; no trial runs."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path
from typing import Any

import httpx
import pytest
from proxy.scripted_engine import ScriptedEngine, ServerThread

from legorl_jax.cli import build_parser
from legorl_jax.core.config import Config, ConfigError, load_config
from legorl_jax.models.config import from_hf_config
from legorl_jax.models.hf_io import read_hf_config
from legorl_jax.models.kv_cache import kv_bytes_per_token
from rollout_server.backends.client import EngineError
from rollout_server.backends.embedded import embedded_plan
from rollout_server.proxy.session import SessionSpec
from rollout_server.server import RolloutServer

CONFIG_CONTEXT = 2048
ENGINE_CONTEXT = 8192


def host_config(**extra: Any) -> Config:
    overrides = {"sandbox.kind": "local", "tasks.demo": "false", "engine.max_context": CONFIG_CONTEXT, **extra}
    return load_config(None, [f"{k}={v}" for k, v in overrides.items()])


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def chat(server: RolloutServer, words: int) -> httpx.Response:
    """One call through the server's proxy, in a session of its own."""
    key = server.service.host.sessions.create(SessionSpec()).key
    body = {"model": "scripted", "max_tokens": 8, "messages": [{"role": "user", "content": "word " * words}]}
    url = f"http://127.0.0.1:{server.service.host.proxy_port}/s/{key}/v1/chat/completions"
    async with httpx.AsyncClient(timeout=60) as client:
        return await client.post(url, json=body)


def test_an_external_engine_that_starts_late_sets_the_context(model_dir: Path, tokenizer: Any) -> None:
    """Started before its engine, as a deployment starts them: the server waits, then holds
    prompts to the engine's 8192 tokens, not to engine.max_context (2048)."""
    port = free_port()
    engine = ScriptedEngine(tokenizer, max_model_len=ENGINE_CONTEXT)
    server = RolloutServer(
        host_config(**{"engine.kind": "external", "engine.url": f"http://127.0.0.1:{port}"}), model_dir
    )

    async def main() -> None:
        starting = asyncio.create_task(server.start())
        await asyncio.sleep(2.0)
        assert not starting.done(), "the server came up without its engine"
        with ServerThread(engine.app, port=port):
            await asyncio.wait_for(starting, timeout=120)
            try:
                assert server.service.limits.max_tokens == ENGINE_CONTEXT
                # Over the config's context but within the engine's: answered.
                assert CONFIG_CONTEXT < len(tokenizer("word " * 1000)["input_ids"]) < ENGINE_CONTEXT
                reply = await chat(server, 1000)
                assert reply.status_code == 200, reply.text
                # Over the engine's: refused by the proxy, naming the engine's limit.
                reply = await chat(server, 3000)
                assert reply.status_code == 400 and str(ENGINE_CONTEXT) in reply.text, reply.text
            finally:
                await server.stop(grace_s=5)

    asyncio.run(main())


def test_an_engine_that_never_answers_stops_start_naming_the_timeout(model_dir: Path) -> None:
    config = host_config(
        **{"engine.kind": "external", "engine.url": f"http://127.0.0.1:{free_port()}", "engine.startup_timeout_s": 1.5}
    )
    server = RolloutServer(config, model_dir)

    async def main() -> None:
        try:
            with pytest.raises(EngineError, match=r"engine.startup_timeout_s=1.5"):
                await asyncio.wait_for(server.start(), timeout=60)
        finally:
            await server.stop(grace_s=1)

    asyncio.run(main())


def test_an_engine_that_gives_no_context_is_refused(model_dir: Path, tokenizer: Any) -> None:
    engine = ScriptedEngine(tokenizer, max_model_len=None)

    async def main() -> None:
        with ServerThread(engine.app) as thread:
            server = RolloutServer(host_config(**{"engine.kind": "external", "engine.url": thread.url}), model_dir)
            try:
                with pytest.raises(EngineError, match="max_model_len"):
                    await asyncio.wait_for(server.start(), timeout=60)
            finally:
                await server.stop(grace_s=1)

    asyncio.run(main())


def test_the_embedded_engine_gets_the_kv_options(model_dir: Path) -> None:
    """The pool /metrics reports is the one the budget and dtype make: 40 blocks of bfloat16
    K/V (float32 would give 20; the default budget, the cap of 2 slots x 1024 tokens = 64)."""
    per_block = 32 * kv_bytes_per_token(from_hf_config(read_hf_config(model_dir)), "bfloat16")
    options = {
        "engine.kind": "embedded",
        "engine.port": 0,
        "engine.max_batch": 2,
        "engine.max_context": 1024,
        "engine.kv_cache_dtype": "bfloat16",
        "engine.kv_cache_memory_bytes": 40 * per_block + 100,
        "engine.max_chunk": 64,
    }
    server = RolloutServer(host_config(**options), model_dir)

    async def main() -> None:
        try:
            await asyncio.wait_for(server.start(), timeout=300)
            async with httpx.AsyncClient(base_url=server.engine.url, timeout=30) as client:
                card = (await client.get("/v1/models")).json()["data"][0]
                metrics = (await client.get("/metrics")).text
            assert card["max_model_len"] == 1024 == server.service.limits.max_tokens
            blocks = [line for line in metrics.splitlines() if line.startswith("legorl:kv_cache_blocks_total")]
            assert len(blocks) == 1 and float(blocks[0].split()[-1]) == 40, blocks
        finally:
            await server.stop(grace_s=5)

    asyncio.run(main())


def test_the_engine_options_reach_the_command_line_or_are_refused() -> None:
    config = host_config(
        **{
            "engine.dtype": "bfloat16",
            "engine.kv_cache_dtype": "bfloat16",
            "engine.kv_cache_memory_bytes": 123456789,
            "engine.max_chunk": 256,
            "engine.port": 8200,
        }
    )
    args = build_parser().parse_args(embedded_plan(config.engine, "/m").command[3:])
    assert (args.dtype, args.kv_cache_dtype, args.kv_cache_memory_bytes, args.max_chunk, args.max_model_len) == (
        "bfloat16",
        "bfloat16",
        123456789,
        256,
        CONFIG_CONTEXT,
    )
    defaults = build_parser().parse_args(embedded_plan(host_config().engine, "/m").command[3:])
    assert (defaults.kv_cache_memory_bytes, defaults.dtype, defaults.enable_prefix_caching) == (None, "float32", True)
    off = host_config(**{"engine.enable_prefix_caching": "false"}).engine
    assert not build_parser().parse_args(embedded_plan(off, "/m").command[3:]).enable_prefix_caching
    # Options only the embedded engine has, given for another kind, name themselves.
    with pytest.raises(ConfigError, match="max_chunk: vLLM has no per-step prefill chunk"):
        host_config(**{"engine.kind": "vllm", "engine.max_chunk": 1024})
    with pytest.raises(ConfigError, match="kv_cache_dtype: vLLM's --kv-cache-dtype has no float32"):
        host_config(**{"engine.kind": "vllm", "engine.kv_cache_dtype": "float32"})
    with pytest.raises(ConfigError, match="kv_cache_memory_bytes"):
        host_config(**{"engine.kind": "external", "engine.url": "http://h:1", "engine.kv_cache_memory_bytes": 1})
    with pytest.raises(ConfigError, match="enable_prefix_caching"):
        host_config(**{"engine.kind": "external", "engine.url": "http://h:1", "engine.enable_prefix_caching": "false"})
