"""The engine's KV-cache path gives the same logits as the full forward."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from tiny_hf import VOCAB, padded_batch

from legorl_jax.models import PAD_POSITION, CausalLM, KVCache, from_hf, init_kv_cache


@nnx.jit
def _decode(model: CausalLM, tokens: jax.Array, positions: jax.Array, cache: KVCache) -> tuple[jax.Array, KVCache]:
    return model.decode(tokens, positions, cache)


def _run_engine(
    model: CausalLM, queues: list[list[np.ndarray]], delays: list[int], chunk: int, max_len: int
) -> dict[tuple[int, int], np.ndarray]:
    """Drive rows like a continuous-batching engine: each row runs its queue of
    sequences one after another (a new sequence reuses the row from position
    0), `chunk` tokens per step, starting after `delays[row]` idle steps.
    Returns {(row, seq index in queue): logits[len, V]}.
    """
    rows = len(queues)
    cache = init_kv_cache(model.config, rows, max_len)
    cursor = [[0, 0] for _ in range(rows)]  # (sequence index, next position)
    got: dict[tuple[int, int], list[np.ndarray]] = {}
    step = 0
    while any(c[0] < len(q) for c, q in zip(cursor, queues, strict=True)):
        toks = np.zeros((rows, chunk), np.int32)
        pos = np.full((rows, chunk), PAD_POSITION, np.int32)
        taken: list[tuple[int, int, int]] = []
        for r in range(rows):
            s, p = cursor[r]
            if step < delays[r] or s >= len(queues[r]):
                continue
            seq = queues[r][s]
            n = min(chunk, len(seq) - p)
            toks[r, :n], pos[r, :n] = seq[p : p + n], np.arange(p, p + n)
            taken.append((r, s, n))
            cursor[r] = [s + 1, 0] if p + n == len(seq) else [s, p + n]
        logits, cache = _decode(model, jnp.asarray(toks), jnp.asarray(pos), cache)
        for r, s, n in taken:
            got.setdefault((r, s), []).append(np.asarray(logits[r, :n]))
        step += 1
    return {k: np.concatenate(v) for k, v in got.items()}


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
@pytest.mark.parametrize(("chunk", "serving"), [(1, False), (4, False), (4, True)])
def test_cached_decode_matches_full_forward(
    arch: str, chunk: int, serving: bool, tiny_hf_checkpoint: Callable[[str], Path]
) -> None:
    """Also set up as the engine serves (weights held whole, decode kernels), against the training forward."""
    model = from_hf(tiny_hf_checkpoint(arch))
    rng = np.random.default_rng(7)
    seqs = [rng.integers(0, VOCAB, n, dtype=np.int32) for n in (11, 5, 14, 3)]
    keys = [(0, 0), (0, 1), (1, 0), (2, 0)]
    # Row 0 reuses its slot for a shorter sequence after the first ends, so
    # stale cache entries beyond the new sequence's length must be ignored.
    queues = [[seqs[0], seqs[3]], [seqs[1]], [seqs[2]]]
    batch, lens = padded_batch([queues[r][s] for r, s in keys])
    full = np.asarray(model(jnp.asarray(batch)))
    if serving:
        model.prepare_for_serving()
        np.testing.assert_allclose(np.asarray(model(jnp.asarray(batch))), full, atol=1e-5, rtol=0)
    got = _run_engine(model, queues, delays=[0, 2, 1], chunk=chunk, max_len=16)
    assert sorted(got) == keys
    for i, key in enumerate(keys):
        assert got[key].shape == (lens[i], VOCAB)
        np.testing.assert_allclose(got[key], full[i, : lens[i]], atol=1e-5, rtol=0)


def test_padding_tokens_leave_cache_untouched() -> None:
    from legorl_jax.models import ModelConfig

    config = ModelConfig(
        architecture="qwen3", vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=1,
        num_heads=2, num_kv_heads=1, head_dim=8, qk_norm=True,
    )  # fmt: skip
    model = CausalLM(config, rngs=nnx.Rngs(0))
    cache = init_kv_cache(config, batch=2, max_len=4)
    cache = KVCache(k=cache.k + 3.0, v=cache.v - 3.0)
    tokens = jnp.array([[5, 6], [7, 8]], jnp.int32)
    positions = jnp.array([[0, PAD_POSITION], [PAD_POSITION, PAD_POSITION]], jnp.int32)
    _, new = model.decode(tokens, positions, cache)
    changed = np.asarray(jnp.any(new.k != cache.k, axis=(0, 1, 4)))
    # Only row 0 slot 0 was written; in particular the last slot (where a
    # wrapped -1 index would land) is intact.
    assert changed.tolist() == [[True, False, False, False], [False, False, False, False]]
    with pytest.raises(ValueError, match="positions shape"):
        model.decode(tokens, positions[:, :1], cache)
    with pytest.raises(ValueError, match="cache has 2 rows"):
        model.decode(tokens[:1], positions[:1], cache)
    with pytest.raises(ValueError, match="batch and max_len must be positive"):
        init_kv_cache(config, batch=0, max_len=4)


def test_block_table_decode_shares_a_prefix_and_reads_only_its_window(
    tiny_hf_checkpoint: Callable[[str], Path],
) -> None:
    """Two rows in a pool of 4-position blocks: the second reuses the first's
    two prefix blocks (computed once) and prefills only its own tail; both
    match the full forward, and a window of 3 blocks is all a step reads."""
    model = from_hf(tiny_hf_checkpoint("llama3"))
    rng = np.random.default_rng(3)
    first = rng.integers(0, VOCAB, 11, dtype=np.int32)
    second = np.concatenate([first[:8], rng.integers(0, VOCAB, 4, dtype=np.int32)])
    cache = init_kv_cache(model.config, batch=10, max_len=4)  # 10 blocks of 4 positions
    tables = jnp.array([[3, 7, 1], [3, 7, 5]], jnp.int32)

    def step(tokens: list[np.ndarray], starts: list[int], cache: KVCache) -> tuple[np.ndarray, KVCache]:
        width = max(len(t) for t in tokens)
        toks = np.zeros((2, width), np.int32)
        pos = np.full((2, width), PAD_POSITION, np.int32)
        for r, (t, s) in enumerate(zip(tokens, starts, strict=True)):
            toks[r, : len(t)], pos[r, : len(t)] = t, np.arange(s, s + len(t))
        logits, cache = model.decode(jnp.asarray(toks), jnp.asarray(pos), cache, tables)
        return np.asarray(logits), cache

    got_first, cache = step([first, first[:0]], [0, 0], cache)
    got_second, cache = step([first[:0], second[8:]], [0, 8], cache)
    full = np.asarray(model(jnp.asarray(np.stack([first, second[:11]]))))
    np.testing.assert_allclose(got_first[0, :11], full[0], atol=1e-5, rtol=0)
    np.testing.assert_allclose(got_second[1, :3], full[1, 8:11], atol=1e-5, rtol=0)
    # Only the listed blocks were written; block 0 (the engine's null block) is untouched.
    written = np.asarray(jnp.any(cache.k != 0, axis=(0, 1, 3, 4)))
    assert np.flatnonzero(written).tolist() == [1, 3, 5, 7]
    # The last-position logits alone are what the engine samples from.
    last, _ = model.decode(jnp.asarray(second[None, 8:]), jnp.arange(8, 12)[None], cache, tables[1:], jnp.array([2]))
    np.testing.assert_allclose(np.asarray(last)[0, 0], full[1, 10], atol=1e-5, rtol=0)


def test_a_serving_decode_step_reads_each_layers_weights_in_place(tiny_hf_checkpoint: Callable[[str], Path]) -> None:
    """The step's program scans one layer body, and its products read the
    stacked weights whole: no layer's projection is copied out of its stack."""
    from legorl_jax.models import cpu_kernels

    if not cpu_kernels.available():
        pytest.skip("the CPU decode kernels are unavailable on this machine")
    model = from_hf(tiny_hf_checkpoint("llama3"))
    model.prepare_for_serving()
    config = model.config
    cache = init_kv_cache(config, batch=2, max_len=8)
    graphdef, state = nnx.split(model)

    def step(state: nnx.State, tokens: jax.Array, positions: jax.Array, cache: KVCache) -> jax.Array:
        return nnx.merge(graphdef, state).decode(tokens, positions, cache)[0]

    tokens, positions = jnp.ones((2, 1), jnp.int32), jnp.ones((2, 1), jnp.int32)
    hlo = jax.jit(step).lower(state, tokens, positions, cache).compile().as_text()
    stacked = f"f32[{config.num_layers},{config.num_heads * config.head_dim},{config.hidden_size}]"
    assert "legorl_decode_matmul" in hlo and stacked in hlo
    # Only one while loop runs the layers; a layer's q_proj [out, in] never exists as its own buffer.
    assert hlo.count("while(") == 1
    one_layer = f"f32[{config.num_heads * config.head_dim},{config.hidden_size}]"
    assert one_layer not in hlo.replace(stacked, "")
