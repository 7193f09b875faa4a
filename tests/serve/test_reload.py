"""Weight reload through vLLM's dev-mode calls: pause → collective_rpc
reload_weights → reset_prefix_cache → resume, with requests in flight."""

from __future__ import annotations

import concurrent.futures
import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import jax.numpy as jnp
import numpy as np
import pytest

from rollout_server.backends.client import EngineError, SyncEngineClient

PROMPT = [31, 8, 77, 402, 5]


def reference_logprobs(model_dir: Path, ids: list[int], temperature: float = 1.0) -> np.ndarray:
    from legorl_jax.models import from_hf, token_logprobs

    return np.asarray(token_logprobs(from_hf(model_dir), jnp.array([ids]), temperature=temperature))[0]


@pytest.fixture(scope="module")
def client(engine: Any) -> SyncEngineClient:
    return SyncEngineClient(engine.url, timeout=120)


def _first_chunk_then_rest(engine: Any, body: dict[str, Any], on_first: Any) -> list[dict[str, Any]]:
    """Streams a completion, calls on_first() after its first chunk, returns all choices."""
    choices = []
    with httpx.stream("POST", engine.url + "/v1/completions", json={**body, "stream": True}, timeout=120) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choices.append(json.loads(line[6:])["choices"][0])
            if len(choices) == 1:
                on_first()
    return choices


def _mid_request(run: Callable[[], list[dict[str, Any]]], landed: Callable[[list[dict[str, Any]]], bool]) -> Any:
    """run() until landed(its choices): a call made after a stream's first chunk can reach a loaded
    engine only after its last (the tiny model decodes its 80 tokens in milliseconds), which
    shows as a whole completion; that try proves nothing either way, so it is made again."""
    tries = 5
    for _ in range(tries):
        choices = run()
        if landed(choices):
            return choices
    raise AssertionError(f"the call made after the first chunk landed after the last in all {tries} tries")


def test_reload_moves_version_and_serves_the_new_weights(
    engine: Any, client: SyncEngineClient, tiny_model_dir: Path, other_weights_dir: Path
) -> None:
    before = client.complete(PROMPT, max_tokens=6, seed=1)[0]
    version = engine.served.engine.weight_version
    result = client.update_weights(str(other_weights_dir))
    assert result["results"][0]["weight_version"] == version + 1
    assert result["results"][0]["weights_path"] == str(other_weights_dir)
    after = client.complete(PROMPT, max_tokens=6, seed=1)[0]
    new_ref = reference_logprobs(other_weights_dir, PROMPT + after.token_ids)[len(PROMPT) - 1 :]
    np.testing.assert_allclose(after.logprobs, new_ref, atol=1e-4)
    old_ref = reference_logprobs(tiny_model_dir, PROMPT + before.token_ids)[len(PROMPT) - 1 :]
    np.testing.assert_allclose(before.logprobs, old_ref, atol=1e-4)
    assert not np.allclose(new_ref, reference_logprobs(tiny_model_dir, PROMPT + after.token_ids)[len(PROMPT) - 1 :])
    # Back to the original weights for the other tests of this module.
    assert client.update_weights(str(tiny_model_dir))["results"][0]["weight_version"] == version + 2


def test_in_flight_request_finishes_under_the_new_weights(
    engine: Any, client: SyncEngineClient, tiny_model_dir: Path, other_weights_dir: Path
) -> None:
    body = {"prompt": PROMPT, "max_tokens": 80, "seed": 2, "logprobs": 0, "return_token_ids": True, "ignore_eos": True}
    seen: list[tuple[list[int], np.ndarray, np.ndarray]] = []

    def run() -> list[dict[str, Any]]:
        try:
            choices = _first_chunk_then_rest(engine, body, lambda: client.update_weights(str(other_weights_dir)))
        finally:
            client.update_weights(str(tiny_model_dir))
        ids = sum((c["token_ids"] for c in choices), [])
        logprobs = np.array(sum((c["logprobs"]["token_logprobs"] for c in choices), []))
        assert len(ids) == 80 and choices[-1]["finish_reason"] == "length"
        old = reference_logprobs(tiny_model_dir, PROMPT + ids)[len(PROMPT) - 1 :]
        new = reference_logprobs(other_weights_dir, PROMPT + ids)[len(PROMPT) - 1 :]
        seen.append((ids, np.abs(logprobs - old) <= 1e-4, np.abs(logprobs - new) <= 1e-4))
        return choices

    # Landed mid-request: some token is not the old weights' (all 80 are when it landed after the last).
    _mid_request(run, lambda _: not np.all(seen[-1][1]))
    _, from_old, from_new = seen[-1]
    assert np.all(from_old | from_new)
    switch = int(np.argmax(~from_old))  # first token not explained by the old weights
    assert 0 < switch < 80, "the reload did not land mid-request"
    assert np.all(from_new[switch:]), "every token after the reload uses the new weights and fresh K/V"


def test_pause_abort_ends_in_flight_requests_cleanly(engine: Any, client: SyncEngineClient) -> None:
    body = {"prompt": PROMPT, "max_tokens": 80, "seed": 3, "return_token_ids": True, "ignore_eos": True}
    paused: dict[str, Any] = {}

    def run() -> list[dict[str, Any]]:
        choices = _first_chunk_then_rest(
            engine, body, lambda: paused.update(httpx.post(engine.url + "/pause", params={"mode": "abort"}).json())
        )
        if choices[-1]["finish_reason"] == "length":  # paused after the completion: resume for the next try
            httpx.post(engine.url + "/resume")
        return choices

    choices = _mid_request(run, lambda choices: choices[-1]["finish_reason"] != "length")
    assert paused["status"] == "paused" and paused["mode"] == "abort"
    assert choices[-1]["finish_reason"] == "abort"
    assert sum(len(c["token_ids"]) for c in choices) < 80
    assert httpx.get(engine.url + "/is_paused").json()["is_paused"] is True
    httpx.post(engine.url + "/resume")
    assert client.complete(PROMPT, max_tokens=2, ignore_eos=True)[0].finish_reason == "length"


def test_requests_sent_while_paused_wait_for_resume(engine: Any, client: SyncEngineClient) -> None:
    httpx.post(engine.url + "/pause", params={"mode": "keep"})
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(client.complete, PROMPT, max_tokens=3, seed=4)
        done = threading.Event()
        pending.add_done_callback(lambda _: done.set())
        assert not done.wait(0.5), "a request completed while the engine was paused"
        reset = httpx.post(engine.url + "/reset_prefix_cache").json()
        assert reset["status"] == "reset"
        httpx.post(engine.url + "/resume")
        assert len(pending.result(timeout=60)[0].token_ids) == 3


def test_pause_wait_drains_in_flight_requests(engine: Any, client: SyncEngineClient) -> None:
    body = {"prompt": PROMPT, "max_tokens": 30, "seed": 5, "return_token_ids": True, "ignore_eos": True}
    choices = _first_chunk_then_rest(
        engine, body, lambda: httpx.post(engine.url + "/pause", params={"mode": "wait"}, timeout=60)
    )
    try:
        assert sum(len(c["token_ids"]) for c in choices) == 30
        assert choices[-1]["finish_reason"] == "length"
    finally:
        httpx.post(engine.url + "/resume")


def test_failed_reload_keeps_serving_the_old_version(engine: Any, client: SyncEngineClient, tmp_path: Path) -> None:
    version = engine.served.engine.weight_version
    with pytest.raises(EngineError) as missing:
        client.update_weights(str(tmp_path / "missing"))
    assert missing.value.status == 400 and "config.json" in missing.value.message
    response = httpx.post(engine.url + "/collective_rpc", json={"method": "rm_rf", "kwargs": {}})
    assert response.status_code == 400 and response.json()["error"]["param"] == "method"
    assert engine.served.engine.weight_version == version
    assert httpx.get(engine.url + "/is_paused").json()["is_paused"] is False
    assert client.complete(PROMPT, max_tokens=2, ignore_eos=True)[0].finish_reason == "length"


def test_reload_of_another_architecture_is_refused(
    engine: Any, client: SyncEngineClient, tmp_path: Path, tiny_model_dir: Path
) -> None:
    from legorl_jax.models.demo_assets import build_tiny_hf_model

    wider = build_tiny_hf_model(tmp_path / "wider", hidden_size=96, tokenizer_dir=tiny_model_dir)
    with pytest.raises(EngineError) as refused:
        client.update_weights(str(wider))
    assert refused.value.status == 400 and "architecture" in refused.value.message
