"""The weight update against a launched vLLM (the stand-in, tests/serve/vllm_standin.py):
native reload, resume whatever fails, the prefix-cache reset checked, a failed
update leaving the previous weights served, prompt logprobs only where they
match the sampling temperature, and a sampling seed of each host's own."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from legorl_jax.core.config import EngineConfig
from rollout_server.backends.client import EngineError, SyncEngineClient
from rollout_server.backends.launch import ManagedEngine, start_engine
from rollout_server.backends.vllm import VllmOptions
from rollout_server.proxy.engine_client import CompletionParams, EngineCompletion, ProxyEngineClient

CONFIG = EngineConfig(kind="vllm", port=0, max_batch=4, max_context=256)
PROMPT = [5, 6, 7, 8]


def _launch(exe: str, model_dir: Path, **options: Any) -> ManagedEngine:
    return start_engine(CONFIG, model_dir, VllmOptions(executable=exe, **options), health_timeout=180, max_restarts=2)


@pytest.fixture
def engine(vllm_standin: str, tiny_model_dir: Path) -> Iterator[ManagedEngine]:
    launched = _launch(vllm_standin, tiny_model_dir)
    yield launched
    launched.stop()


@pytest.fixture
def client(engine: ManagedEngine) -> Iterator[SyncEngineClient]:
    sync = engine.sync_client(timeout=120)
    yield sync
    sync.close()


def _state(engine: ManagedEngine) -> dict[str, Any]:
    return httpx.get(f"{engine.url}/standin/state", timeout=30).json()


def _arm(engine: ManagedEngine, **faults: int) -> None:
    httpx.post(f"{engine.url}/standin/faults", json=faults, timeout=30).raise_for_status()


def _greedy(client: SyncEngineClient) -> list[int]:
    return client.complete(PROMPT, max_tokens=6, temperature=0, ignore_eos=True)[0].token_ids


def test_native_reload_serves_what_a_fresh_start_on_those_weights_serves(
    engine: ManagedEngine, client: SyncEngineClient, vllm_standin: str, other_weights_dir: Path
) -> None:
    before = _greedy(client)
    client.update_weights(str(other_weights_dir))
    fresh = _launch(vllm_standin, other_weights_dir)
    try:
        fresh_client = fresh.sync_client(timeout=120)
        assert _state(engine)["params"] == _state(fresh)["params"]
        assert _greedy(client) == _greedy(fresh_client) != before
    finally:
        fresh.stop()
    assert engine.installed() == str(other_weights_dir)


def test_a_failed_pause_still_resumes(engine: ManagedEngine, client: SyncEngineClient, other_weights_dir: Path) -> None:
    before = _state(engine)["params"]
    _arm(engine, pause=1)
    with pytest.raises(EngineError, match="pause"):
        client.update_weights(str(other_weights_dir))
    assert httpx.get(f"{engine.url}/is_paused").json() == {"is_paused": False}
    assert _state(engine)["params"] == before and engine.installed() != str(other_weights_dir)
    assert len(client.complete(PROMPT, max_tokens=2, ignore_eos=True)[0].token_ids) == 2  # serving, not stuck paused


def test_a_failed_reload_is_reported_and_the_previous_weights_served(
    engine: ManagedEngine, client: SyncEngineClient, tiny_model_dir: Path, other_weights_dir: Path
) -> None:
    before, greedy = _state(engine)["params"], _greedy(client)
    _arm(engine, reload=1)  # dies half-way through copying the new weights
    with pytest.raises(EngineError, match=f"serves {tiny_model_dir} again"):
        client.update_weights(str(other_weights_dir))
    assert _state(engine)["params"] == before and _greedy(client) == greedy
    assert engine.installed() == str(tiny_model_dir) and engine.epoch() == 0


def test_when_the_previous_weights_cannot_be_reloaded_the_engine_restarts_on_them(
    engine: ManagedEngine, client: SyncEngineClient, tiny_model_dir: Path, other_weights_dir: Path
) -> None:
    before, greedy = _state(engine)["params"], _greedy(client)
    assert engine.supervisor is not None
    first_pid = engine.supervisor.pid
    _arm(engine, reload=2)  # the update and the restore both fail
    with pytest.raises(EngineError, match=f"restarting on {tiny_model_dir}"):
        client.update_weights(str(other_weights_dir))
    supervisor = engine.supervisor
    deadline = time.monotonic() + 180
    # A planned restart: the engine was alive on the wrong weights, so it spends no crash budget.
    while not (engine.epoch() == 1 and supervisor.state == "healthy"):
        assert time.monotonic() < deadline, "no restart"
        time.sleep(0.2)
    assert supervisor.pid != first_pid and engine.epoch() == 1 and supervisor.restarts == 0
    assert _state(engine)["params"] == before and _greedy(client) == greedy


def test_a_prefix_cache_reset_that_did_not_take_fails_the_update(
    engine: ManagedEngine, client: SyncEngineClient, tiny_model_dir: Path, other_weights_dir: Path
) -> None:
    before = _state(engine)["params"]
    _arm(engine, reset=1)
    with pytest.raises(EngineError, match="prefix cache not reset"):
        client.update_weights(str(other_weights_dir))
    assert _state(engine)["params"] == before and engine.installed() == str(tiny_model_dir)
    client.update_weights(str(other_weights_dir))  # the next try goes through
    assert engine.installed() == str(other_weights_dir)


@pytest.mark.parametrize("version", ["0.17.1", "0.33.0"])
def test_an_update_with_requests_in_flight_leaves_no_kv_from_the_old_weights(
    vllm_standin: str, tiny_model_dir: Path, other_weights_dir: Path, monkeypatch: pytest.MonkeyPatch, version: str
) -> None:
    """keep mode freezes the running request; the reset preempts it, so it recomputes
    its KV under the new weights (0.17.1 answers the reset with no verdict, 0.33.0 with one)."""
    monkeypatch.setenv("STANDIN_TOKEN_DELAY_S", "0.05")
    monkeypatch.setenv("STANDIN_VLLM_VERSION", version)
    engine = _launch(vllm_standin, tiny_model_dir)
    try:
        client = engine.sync_client(timeout=120)
        done: list[int] = []
        worker = threading.Thread(
            target=lambda: done.extend(client.complete(PROMPT, max_tokens=40, ignore_eos=True)[0].token_ids)
        )
        worker.start()
        while not _state(engine)["running"]:
            time.sleep(0.02)
        engine.sync_client(timeout=120).update_weights(str(other_weights_dir))
        assert _state(engine)["stale_kv_requests"] == 0
        worker.join(60)
        assert len(done) == 40
    finally:
        engine.stop()


def test_vllm_prompt_logprobs_are_refused_off_temperature_one(client: SyncEngineClient) -> None:
    sampled = client.complete(PROMPT, max_tokens=3, seed=4, ignore_eos=True)[0]
    with pytest.raises(EngineError, match="temperature 1") as err:
        client.complete(PROMPT + sampled.token_ids, max_tokens=1, temperature=0.5, prompt_logprobs=0)
    assert err.value.param == "prompt_logprobs"
    # At temperature 1 they are the sampled tokens' own logprobs: recomputing stands in for behaviour.
    rescored = client.complete(PROMPT + sampled.token_ids, max_tokens=1, prompt_logprobs=0)[0]
    assert rescored.prompt_logprobs is not None
    assert rescored.prompt_logprobs[len(PROMPT) :] == pytest.approx(sampled.logprobs, abs=1e-6)


def test_two_hosts_sample_different_sequences(vllm_standin: str, tiny_model_dir: Path, engine: ManagedEngine) -> None:
    other = _launch(vllm_standin, tiny_model_dir)
    try:
        samples = [
            [c.complete(PROMPT, max_tokens=8, ignore_eos=True)[0].token_ids for _ in range(3)]
            for c in (engine.sync_client(timeout=120), other.sync_client(timeout=120))
        ]
        assert samples[0] != samples[1]
        assert _state(engine)["seed"] != _state(other)["seed"]
    finally:
        other.stop()


@pytest.mark.parametrize("version", ["0.17.1", "0.33.0"])
def test_vllm_per_token_versions_reach_the_proxy_as_the_embedded_engine_s(
    vllm_standin: str, tiny_model_dir: Path, other_weights_dir: Path, monkeypatch: pytest.MonkeyPatch, version: str
) -> None:
    """The update labels the new weights; 0.33.0's spans split a completion in flight into
    per-token policy versions, 0.17.1 (no labels, no spans) leaves them unknown."""
    monkeypatch.setenv("STANDIN_TOKEN_DELAY_S", "0.05")
    monkeypatch.setenv("STANDIN_VLLM_VERSION", version)
    engine = _launch(vllm_standin, tiny_model_dir)
    try:
        client = engine.sync_client(timeout=120)
        client.update_weights(str(tiny_model_dir), version="0")  # as a rollout server labels at start

        async def complete() -> EngineCompletion:
            proxy_client = ProxyEngineClient(engine.url, client.model(), timeout_s=120)
            try:
                # top_k 1: greedy, so the completion runs its full length every time.
                return await proxy_client.complete(PROMPT, CompletionParams(1.0, 1.0, 1, 40, ()))
            finally:
                await proxy_client.aclose()

        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pending = pool.submit(asyncio.run, complete())
            while not _state(engine)["running"]:
                time.sleep(0.02)
            time.sleep(0.3)  # a few tokens in
            client.update_weights(str(other_weights_dir), version="1")
            completion = pending.result(timeout=60)
    finally:
        engine.stop()
    assert len(completion.token_ids) == 40
    if version == "0.17.1":
        assert completion.versions is None
        return
    assert completion.versions is not None
    switch = completion.versions.index(1)
    assert 0 < switch < 40 and completion.versions == (0,) * switch + (1,) * (40 - switch)
