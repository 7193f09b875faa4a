"""Packed rows with segment ids give the same per-segment logits as unpacked rows."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from tiny_hf import VOCAB, padded_batch

from legorl_jax.models import from_hf
from legorl_jax.models.layers import segment_positions


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_packed_segments_match_unpacked(arch: str, tiny_hf_checkpoint: Callable[[str], Path]) -> None:
    model = from_hf(tiny_hf_checkpoint(arch))
    rng = np.random.default_rng(3)
    lengths = [[7, 12, 5], [20, 4]]  # two packed rows of 24 tokens (last one padded)
    row_len = 26
    packed = np.zeros((2, row_len), np.int32)
    segments = np.zeros((2, row_len), np.int32)
    pieces: list[tuple[int, int, np.ndarray]] = []
    for r, row in enumerate(lengths):
        start = 0
        for s, n in enumerate(row):
            seq = rng.integers(0, VOCAB, n, dtype=np.int32)
            packed[r, start : start + n], segments[r, start : start + n] = seq, s + 1
            pieces.append((r, start, seq))
            start += n
    logits = np.asarray(model(jnp.asarray(packed), segment_ids=jnp.asarray(segments)))
    alone, lens = padded_batch([seq for _, _, seq in pieces])
    alone_logits = np.asarray(model(jnp.asarray(alone)))
    for i, (r, start, seq) in enumerate(pieces):
        got = logits[r, start : start + len(seq)]
        np.testing.assert_allclose(got, alone_logits[i, : lens[i]], atol=1e-5, rtol=0)


def test_positions_restart_per_segment() -> None:
    seg = jnp.array([[1, 1, 1, 2, 2, 3, 0, 0]])
    assert segment_positions(seg).tolist() == [[0, 1, 2, 0, 1, 0, 0, 1]]


def test_explicit_positions_are_used(tiny_hf_checkpoint: Callable[[str], Path]) -> None:
    model = from_hf(tiny_hf_checkpoint("qwen3"))
    tokens = jnp.asarray(np.random.default_rng(4).integers(0, VOCAB, (1, 6), dtype=np.int32))
    default = model(tokens)
    np.testing.assert_array_equal(model(tokens, positions=jnp.arange(6)[None]), default)
    # RoPE is relative: shifting all positions leaves logits (nearly) unchanged,
    # while a non-uniform change does not.
    np.testing.assert_allclose(model(tokens, positions=jnp.arange(6)[None] + 9), default, atol=1e-4)
    assert np.abs(model(tokens, positions=jnp.array([[0, 1, 2, 5, 6, 7]])) - default).max() > 1e-2
