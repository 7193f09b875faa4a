"""The KV block pool's bookkeeping: reservations, prefix reuse, LRU eviction, reset."""

from __future__ import annotations

import pytest

from legorl_jax.serve.blocks import NULL_BLOCK, BlockPool


def _computed(pool: BlockPool, blocks: list[int], tokens: list[int]) -> None:
    """As the engine does once a row's K/V is computed up to len(tokens)."""
    pool.register(blocks, tokens, len(tokens), 0, None)


def test_reservation_waits_for_free_blocks_and_never_hands_out_the_null_block() -> None:
    pool = BlockPool(num_blocks=5, block_size=4)
    got = pool.allocate([1, 2, 3], reserve=10, reuse=True)  # 3 blocks
    assert got is not None and got[1] == 0 and NULL_BLOCK not in got[0]
    assert pool.used == 3 and pool.allocate([7], reserve=8, reuse=True) is None
    pool.release(got[0])
    assert pool.used == 0 and pool.allocate([7], reserve=16, reuse=True) is not None
    with pytest.raises(ValueError):
        BlockPool(1, 4)


def test_a_shared_prefix_is_computed_once() -> None:
    pool = BlockPool(num_blocks=16, block_size=4)
    first = list(range(10))
    blocks, hit = pool.allocate(first, 12, reuse=True)  # type: ignore[misc]
    assert hit == 0
    _computed(pool, blocks, first)  # two full blocks registered
    # A longer prompt with the same first 8 tokens shares both blocks.
    second = first[:8] + [50, 51, 52]
    shared, hit = pool.allocate(second, 12, reuse=True)  # type: ignore[misc]
    assert hit == 8 and shared[:2] == blocks[:2] and shared[2] != blocks[2]
    # The last prompt token is always recomputed: an 8-token prompt reuses one block.
    _, hit = pool.allocate(first[:8], 8, reuse=True)  # type: ignore[misc]
    assert hit == 4
    # A different first block shares nothing, even with an equal second block.
    _, hit = pool.allocate([99, *first[1:]], 12, reuse=True)  # type: ignore[misc]
    assert hit == 0
    assert pool.queried_tokens == 10 + 11 + 8 + 10 and pool.hit_tokens == 12


def test_idle_prefixes_are_evicted_least_recently_used_first() -> None:
    pool = BlockPool(num_blocks=5, block_size=2)  # 4 usable blocks
    a, b = [1, 2, 3], [4, 5, 6]
    for prompt in (a, b):
        blocks, _ = pool.allocate(prompt, 4, reuse=True)  # type: ignore[misc]
        _computed(pool, blocks, prompt)
        pool.release(blocks)
    assert pool.used == 0
    # Reusing a makes b the least recently used; a 3-block request evicts b's block.
    blocks, hit = pool.allocate(a, 4, reuse=True)  # type: ignore[misc]
    assert hit == 2
    pool.release(blocks)
    pool.release(pool.allocate([9], 6, reuse=False)[0])  # type: ignore[index]
    assert pool.allocate(a, 2, reuse=True)[1] == 2  # type: ignore[index]
    assert pool.allocate(b, 2, reuse=True)[1] == 0  # type: ignore[index]


def test_reset_forgets_every_prefix() -> None:
    pool = BlockPool(num_blocks=8, block_size=2)
    prompt = [1, 2, 3, 4, 5]
    blocks, _ = pool.allocate(prompt, 6, reuse=True)  # type: ignore[misc]
    _computed(pool, blocks, prompt)
    pool.reset()  # e.g. new weights: K/V computed by the old ones must not be served
    assert pool.allocate(prompt, 6, reuse=True)[1] == 0  # type: ignore[index]
    assert pool.used == 6


def test_with_caching_off_nothing_is_shared_but_lookups_are_counted() -> None:
    pool = BlockPool(num_blocks=8, block_size=4, caching=False)
    prompt = list(range(10))
    blocks, hit = pool.allocate(prompt, 12, reuse=True)  # type: ignore[misc]
    _computed(pool, blocks, prompt)
    again, hit = pool.allocate(prompt, 12, reuse=True)  # type: ignore[misc]
    assert hit == 0 and not set(again) & set(blocks)
    assert (pool.queried_tokens, pool.hit_tokens) == (20, 0)
    pool.release(blocks)
    pool.release(again)
    # Released blocks are free, not kept for a prefix: all 7 can be reserved at once.
    assert pool.used == 0 and pool.allocate(prompt, 28, reuse=True) is not None
