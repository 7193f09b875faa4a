"""Packing of one engine step from slot states."""

from __future__ import annotations

import pytest

from legorl_jax.serve.engine import GenRequest, SamplingParams, Slot
from legorl_jax.serve.scheduling import build_inputs, chunk_buckets, pick_bucket, row_buckets


def _slot(prompt: list[int], generated: list[int] = (), cached: int = 0, seed: int = 1) -> Slot:
    req = GenRequest("r", prompt, SamplingParams(max_tokens=8, temperature=0.5, seed=seed), lambda e: None)
    return Slot(req, [*prompt, *generated], cached=cached)


def test_buckets() -> None:
    assert chunk_buckets(256) == (1, 4, 16, 64, 256)
    assert chunk_buckets(100) == (1, 4, 16, 64, 100)
    assert chunk_buckets(1) == (1,)
    assert row_buckets(32) == (4, 16, 32) and row_buckets(8) == (4, 8) and row_buckets(2) == (2,)
    assert pick_bucket(5, (1, 4, 16)) == 16 and pick_bucket(40, (1, 4, 16)) == 16
    with pytest.raises(ValueError):
        chunk_buckets(0)


def test_prefill_and_decode_rows_share_one_step() -> None:
    prefill = _slot([10, 11, 12, 13, 14])
    decode = _slot([20, 21], generated=[22], cached=2, seed=2**33 + 5)
    inputs, fed = build_inputs([prefill, None, decode, None, None], (1, 4, 16), (3, 5))
    assert fed == [5, 0, 1, 0, 0]
    assert inputs.tokens.shape == (3, 16)
    assert inputs.tokens[0, :5].tolist() == [10, 11, 12, 13, 14]
    assert inputs.positions[0, :6].tolist() == [0, 1, 2, 3, 4, -1]
    assert inputs.targets[0, :5].tolist() == [11, 12, 13, 14, -1]
    assert inputs.last.tolist() == [4, 0, 0]
    assert (inputs.positions[1] == -1).all()
    assert inputs.tokens[2, 0] == 22 and inputs.positions[2, :2].tolist() == [2, -1]
    assert inputs.counters.tolist() == [0, 0, 1]
    assert inputs.seeds[2] == 5  # seeds wrap to 32 bits


def test_long_prompt_is_fed_in_chunks() -> None:
    slot = _slot(list(range(40)), cached=16)
    inputs, fed = build_inputs([slot], (1, 4, 16), (1,))
    assert fed == [16]
    assert inputs.positions[0].tolist() == list(range(16, 32))


def test_step_covers_only_the_rows_up_to_the_last_active_slot() -> None:
    slots = [None, _slot([1, 2]), None, None, None, None, None, None]
    inputs, fed = build_inputs(slots, (1, 4), (4, 8))
    assert inputs.tokens.shape == (4, 4) and fed[1] == 2
    slots[5] = _slot([3])
    assert build_inputs(slots, (1, 4), (4, 8))[0].tokens.shape == (8, 4)
