"""The KV block pool behind the HTTP surface: a cached prompt prefix is not
recomputed (and gives the same logprobs), new weights or /reset_prefix_cache
forget every prefix, and requests beyond the pool wait instead of growing it."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jax.numpy as jnp
import numpy as np
import pytest

from rollout_server.backends.client import SyncEngineClient

# The tiny model's K/V: 2 layers x 2 heads x 16 dims x (k, v) x 4 bytes = 512 bytes a
# token, 16 KiB a 32-position block. Six blocks: one request of 100 tokens at a time.
POOL_BYTES = 6 * 32 * 512
PROMPT = [int(t) for t in np.random.default_rng(11).integers(300, 1000, 70)]


@pytest.fixture(scope="module")
def small_pool(tiny_model_dir: Path) -> Iterator[Any]:
    from legorl_jax.serve.server import EmbeddedEngine

    with EmbeddedEngine.start(
        tiny_model_dir, max_slots=4, max_len=256, max_chunk=32, kv_cache_memory_bytes=POOL_BYTES
    ) as running:
        yield running


def _reference(model_dir: Path, ids: list[int]) -> np.ndarray:
    from legorl_jax.models import from_hf, token_logprobs

    return np.asarray(token_logprobs(from_hf(model_dir), jnp.array([ids])))[0]


def _hits(engine: Any) -> int:
    return engine.served.engine.stats()["prefix_cache_hits"]


def test_a_cached_prefix_is_not_recomputed_and_scores_the_same(small_pool: Any, tiny_model_dir: Path) -> None:
    client = SyncEngineClient(small_pool.url, timeout=120)
    client.complete(PROMPT, max_tokens=2, temperature=0.0)
    before = _hits(small_pool)
    longer = PROMPT + [5, 6, 7]
    got = client.complete(longer, max_tokens=4, temperature=0.0)[0]
    assert _hits(small_pool) - before == 64  # two full 32-token blocks of the 70-token prefix
    ref = _reference(tiny_model_dir, longer + got.token_ids)[len(longer) - 1 :]
    np.testing.assert_allclose(got.logprobs, ref, atol=1e-4)
    metrics = httpx.get(small_pool.url + "/metrics").text
    assert "vllm:prefix_cache_hits_total" in metrics and "vllm:kv_cache_usage_perc" in metrics


def test_new_weights_and_reset_forget_every_prefix(
    small_pool: Any, tiny_model_dir: Path, other_weights_dir: Path
) -> None:
    client = SyncEngineClient(small_pool.url, timeout=120)
    client.complete(PROMPT, max_tokens=1)
    client.update_weights(str(other_weights_dir))
    try:
        before = _hits(small_pool)
        got = client.complete(PROMPT, max_tokens=3, temperature=0.0)[0]
        assert _hits(small_pool) == before  # nothing computed by the old weights is served
        ref = _reference(other_weights_dir, PROMPT + got.token_ids)[len(PROMPT) - 1 :]
        np.testing.assert_allclose(got.logprobs, ref, atol=1e-4)
    finally:
        client.update_weights(str(tiny_model_dir))
    client.complete(PROMPT, max_tokens=1)
    httpx.post(small_pool.url + "/reset_prefix_cache").raise_for_status()
    before = _hits(small_pool)
    client.complete(PROMPT, max_tokens=1)
    assert _hits(small_pool) == before


def test_requests_beyond_the_pool_wait_and_too_long_ones_are_refused(small_pool: Any) -> None:
    client = SyncEngineClient(small_pool.url, timeout=120)
    prompts = [[t + 3 * i for t in PROMPT] for i in range(3)]  # 70 + 30 tokens each: 4 of the 6 blocks
    alone = [client.complete(p, max_tokens=30, temperature=0.0)[0].token_ids for p in prompts]
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        together = list(pool.map(lambda p: client.complete(p, max_tokens=30, temperature=0.0)[0].token_ids, prompts))
    assert together == alone
    stats = small_pool.served.engine.stats()
    assert stats["kv_blocks_used"] == 0 and stats["kv_blocks_total"] == 6
    r = httpx.post(small_pool.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 150})
    assert r.status_code == 400 and "KV cache holds 192 tokens" in r.json()["error"]["message"]


def test_with_prefix_caching_off_a_repeated_prompt_prefills_in_full(small_pool: Any, tiny_model_dir: Path) -> None:
    """Counters: a repeat of the 70-token prompt takes its three 32-token prefill
    chunks again (one with the cache on), hits none, and samples the same."""
    from legorl_jax.serve.server import EmbeddedEngine

    def twice(running: Any) -> tuple[list[Any], int, dict[str, int]]:
        client = SyncEngineClient(running.url, timeout=120)
        client.complete(PROMPT, max_tokens=1)
        before = running.served.engine.stats()
        got = client.complete(PROMPT, max_tokens=3, temperature=0.0)[0]
        after = running.served.engine.stats()
        return [got.token_ids, got.logprobs], after["steps"] - before["steps"], after

    on, on_steps, _ = twice(small_pool)
    with EmbeddedEngine.start(
        tiny_model_dir, max_slots=4, max_len=256, max_chunk=32, kv_cache_memory_bytes=POOL_BYTES,
        enable_prefix_caching=False,
    ) as off_engine:  # fmt: skip
        off, off_steps, stats = twice(off_engine)
        metrics = httpx.get(off_engine.url + "/metrics").text
    assert (on_steps, off_steps) == (1 + 2, 3 + 2)  # prefill steps + the two decode steps
    assert stats["prefix_cache_hits"] == 0 and stats["prefix_cache_queries"] == 2 * len(PROMPT)
    lines = [line for line in metrics.splitlines() if line.startswith("vllm:prefix_cache")]
    reported = {line.split("{")[0]: float(line.split()[-1]) for line in lines}
    assert (reported["vllm:prefix_cache_queries_total"], reported["vllm:prefix_cache_hits_total"]) == (140, 0)
    assert off[0] == on[0]
    np.testing.assert_allclose(off[1], on[1], atol=1e-5)
