"""The vLLM stand-in itself (a test instrument): the pause modes and the
per-token weight versions later work relies on, as vLLM's source describes them."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from legorl_jax.core.config import EngineConfig
from rollout_server.backends.launch import ManagedEngine, start_engine
from rollout_server.backends.vllm import VllmOptions


def _launch(exe: str, model_dir: Path, monkeypatch: pytest.MonkeyPatch, version: str) -> ManagedEngine:
    monkeypatch.setenv("STANDIN_TOKEN_DELAY_S", "0.05")
    monkeypatch.setenv("STANDIN_VLLM_VERSION", version)
    config = EngineConfig(kind="vllm", port=0, max_batch=4, max_context=256)
    return start_engine(config, model_dir, VllmOptions(executable=exe), health_timeout=180)


@pytest.fixture
def slow_engine(vllm_standin: str, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[ManagedEngine]:
    engine = _launch(vllm_standin, tiny_model_dir, monkeypatch, "0.33.0")
    yield engine
    engine.stop()


def _in_flight(engine: ManagedEngine, **body: Any) -> tuple[threading.Thread, list[dict[str, Any]]]:
    """Starts one completion in a thread; returns once the engine runs it."""
    out: list[dict[str, Any]] = []
    model = httpx.get(f"{engine.url}/v1/models").json()["data"][0]["id"]
    request = {"model": model, "prompt": [5, 6, 7], "max_tokens": 30, "ignore_eos": True, "logprobs": 0, **body}
    thread = threading.Thread(
        target=lambda: out.append(httpx.post(f"{engine.url}/v1/completions", json=request, timeout=120).json())
    )
    thread.start()
    while not httpx.get(f"{engine.url}/standin/state").json()["running"]:
        time.sleep(0.02)
    time.sleep(0.3)  # a few tokens in
    return thread, out


def test_keep_mode_labels_each_token_with_the_weights_that_sampled_it(
    slow_engine: ManagedEngine, other_weights_dir: Path
) -> None:
    url = slow_engine.url
    thread, out = _in_flight(slow_engine, return_weight_versions=True)
    assert httpx.post(f"{url}/pause", params={"mode": "keep"}).json() == {"status": "paused"}
    assert httpx.get(f"{url}/is_paused").json() == {"is_paused": True}
    rpc = {"method": "reload_weights", "kwargs": {"weights_path": str(other_weights_dir)}}
    assert httpx.post(f"{url}/collective_rpc", json=rpc).json() == {"results": [None]}
    assert httpx.post(f"{url}/update_weight_version", json={"new_version": "1"}).json()["success"] is True
    assert httpx.post(f"{url}/reset_prefix_cache", params={"reset_running_requests": "true"}).json() == {
        "success": True
    }
    httpx.post(f"{url}/resume")
    thread.join(60)
    choice = out[0]["choices"][0]
    spans = choice["weight_versions"]
    assert [s["version"] for s in spans] == ["default", "1"] and spans[0]["start"] == 0 and spans[-1]["end"] == 30
    assert 0 < spans[0]["end"] == spans[1]["start"] < 30 and choice["finish_reason"] == "length"


def test_a_reset_without_preempting_fails_while_requests_hold_kv(slow_engine: ManagedEngine) -> None:
    url = slow_engine.url
    thread, _ = _in_flight(slow_engine)
    httpx.post(f"{url}/pause", params={"mode": "keep"})
    assert httpx.post(f"{url}/reset_prefix_cache").json() == {"success": False}
    httpx.post(f"{url}/resume")
    thread.join(60)
    assert httpx.post(f"{url}/reset_prefix_cache").json() == {"success": True}  # nothing running now


def test_abort_mode_ends_requests_in_flight(slow_engine: ManagedEngine) -> None:
    thread, out = _in_flight(slow_engine)
    httpx.post(f"{slow_engine.url}/pause", params={"mode": "abort"})
    thread.join(10)
    httpx.post(f"{slow_engine.url}/resume")
    assert out[0]["choices"][0]["finish_reason"] == "abort" and len(out[0]["choices"][0]["token_ids"]) < 30


def test_as_0_17_it_has_no_version_labels_and_no_reset_verdict(
    vllm_standin: str, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = _launch(vllm_standin, tiny_model_dir, monkeypatch, "0.17.1")
    try:
        assert httpx.post(f"{engine.url}/update_weight_version", json={"new_version": "1"}).status_code == 404
        reset = httpx.post(f"{engine.url}/reset_prefix_cache", params={"reset_running_requests": "true"})
        assert reset.status_code == 200 and reset.content == b""
    finally:
        engine.stop()
