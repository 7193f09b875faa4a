"""Packing of one engine step from slot states."""

from __future__ import annotations

import pytest

from legorl_jax.serve.request_types import GenRequest, SamplingParams, Slot
from legorl_jax.serve.scheduling import (
    build_inputs,
    chunk_buckets,
    pick_bucket,
    row_buckets,
    step_groups,
    window_buckets,
)

BLOCK = 4
WINDOWS = (2, 4, 16)  # in blocks of BLOCK positions


def _slot(prompt: list[int], generated: list[int] = (), cached: int = 0, seed: int = 1) -> Slot:
    req = GenRequest("r", prompt, SamplingParams(max_tokens=8, temperature=0.5, seed=seed), lambda e: None)
    blocks = list(range(100 + seed % 7 * 20, 120 + seed % 7 * 20))
    return Slot(req, [*prompt, *generated], blocks, cached=cached)


def _build(slots: list[Slot], chunks: tuple[int, ...], rows: tuple[int, ...]):  # noqa: ANN202
    return build_inputs(slots, chunks, rows, WINDOWS, BLOCK)


def test_buckets() -> None:
    assert chunk_buckets(256) == (1, 4, 16, 64, 256)
    assert chunk_buckets(100) == (1, 4, 16, 64, 100)
    assert chunk_buckets(1) == (1,)
    assert row_buckets(32) == (1, 2, 4, 8, 16, 32) and row_buckets(12) == (1, 2, 4, 8, 12) and row_buckets(1) == (1,)
    assert pick_bucket(5, (1, 4, 16)) == 16 and pick_bucket(40, (1, 4, 16)) == 16
    with pytest.raises(ValueError):
        chunk_buckets(0)
    # Windows grow by a quarter from 256 positions to 4096, then 4096 at a time.
    quarter = (8, 10, 13, 17, 22, 28, 35, 44, 55, 69, 87, 109, 128)
    assert window_buckets(1024, 32) == (*quarter, 256, 384, 512, 640, 768, 896, 1024)
    assert window_buckets(3, 32) == (3,) and window_buckets(20, 32) == (8, 10, 13, 17, 20)
    # A decode step at 520 positions reads 544 (17 blocks), not 1,024.
    assert pick_bucket(-(-520 // 32), window_buckets(128, 32)) == 17


def test_decoding_and_prefilling_slots_run_as_separate_calls() -> None:
    prefill = _slot([10, 11, 12, 13, 14])
    decode = _slot([20, 21], generated=[22], cached=2, seed=2**33 + 5)
    assert step_groups([prefill, None, decode, None, _slot([1], cached=1)]) == [[2], [0]]
    inputs, fed = _build([prefill, decode], (1, 4, 16), (3, 5))
    assert fed == [5, 1]
    assert inputs.tokens.shape == (3, 16)  # two slots, padded to the 3-row bucket
    assert inputs.tokens[0, :5].tolist() == [10, 11, 12, 13, 14]
    assert inputs.positions[0, :6].tolist() == [0, 1, 2, 3, 4, -1]
    assert inputs.targets[0, :5].tolist() == [11, 12, 13, 14, -1]
    assert inputs.last.tolist() == [4, 0, 0]
    assert (inputs.positions[2] == -1).all()
    assert inputs.tokens[1, 0] == 22 and inputs.positions[1, :2].tolist() == [2, -1]
    assert inputs.counters.tolist() == [0, 1, 0]
    assert inputs.seeds[1] == 5  # seeds wrap to 32 bits
    # The window is the smallest bucket holding the longest row (5 positions: 2 blocks).
    assert inputs.block_table.shape == (3, 2)
    assert inputs.block_table.tolist() == [prefill.blocks[:2], decode.blocks[:2], [0, 0]]


def test_long_prompt_is_fed_in_chunks() -> None:
    slot = _slot(list(range(40)), cached=16)
    inputs, fed = _build([slot], (1, 4, 16), (1,))
    assert fed == [16]
    assert inputs.positions[0].tolist() == list(range(16, 32))
    # 32 positions reached: 8 blocks, so the 16-block window.
    assert inputs.block_table.shape == (1, 16)


def test_step_rows_follow_the_number_of_slots_fed() -> None:
    assert _build([_slot([1, 2])], (1, 4), (4, 8))[0].tokens.shape == (4, 4)
    assert _build([_slot([1, 2])] * 5, (1, 4), (4, 8))[0].tokens.shape == (8, 4)


def test_long_windows_take_smaller_chunks() -> None:
    slot = _slot(list(range(60)), cached=20)  # 40 pending
    inputs, fed = build_inputs([slot], (1, 4, 16), (1,), WINDOWS, BLOCK, max_pairs=16 * 16 * BLOCK)
    assert fed == [16] and inputs.block_table.shape == (1, 16)
    # Half the pairs: a 4-token chunk (window 16 blocks still) fits where 16 does not.
    inputs, fed = build_inputs([slot], (1, 4, 16), (1,), WINDOWS, BLOCK, max_pairs=8 * 16 * BLOCK)
    assert fed == [4] and inputs.tokens.shape == (1, 4)
