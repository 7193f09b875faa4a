"""Packing sequences into bucketed, segment-aware micro-batches."""

from __future__ import annotations

import numpy as np
import pytest

from legorl_jax.rl.batching import TrainSequence, pack_step, row_counts


def _seq(length: int, start: int, adv: float = 1.0, prompt: int = 2, version: int = 0) -> TrainSequence:
    mask = np.arange(length) >= prompt
    return TrainSequence(
        np.arange(start, start + length, dtype=np.int32),
        mask,
        np.where(mask, -0.5, 0.0).astype(np.float32),
        adv,
        version,
    )


def _unpack(step) -> dict[int, dict]:
    """Reads every sequence back out of the packed layout, keyed by first token id."""
    found = {}
    for mb in step.micro_batches:
        for r in range(mb.tokens.shape[0]):
            for seg in np.unique(mb.segment_ids[r]):
                if seg == 0:
                    continue
                idx = np.flatnonzero(mb.segment_ids[r] == seg)
                assert np.array_equal(idx, np.arange(idx[0], idx[-1] + 1)), "segment not contiguous"
                shifted = idx[1:] - 1  # targets of tokens 1..n-1 of the segment
                found[int(mb.tokens[r, idx[0]])] = {
                    "tokens": mb.tokens[r, idx],
                    "positions": mb.positions[r, idx],
                    "target_mask": mb.loss_mask[r, shifted],
                    "target_adv": mb.advantages[r, shifted],
                    "target_weight": mb.loss_weight[r, shifted],
                    "target_behav": mb.behavior_logprobs[r, shifted],
                    "seq_ids": mb.seq_ids[r, shifted],
                    "bucket": mb.tokens.shape[1],
                }
    return found


def test_round_trip_layout_buckets_and_token_budget() -> None:
    lengths = [5, 30, 7, 60, 12, 3, 31, 9]
    seqs = [_seq(n, 1000 * (i + 1), adv=float(i)) for i, n in enumerate(lengths)]
    step = pack_step(seqs, buckets=[16, 32, 64], micro_batch_tokens=128, max_segments=3)
    got = _unpack(step)
    assert len(got) == len(seqs)
    for i, s in enumerate(seqs):
        g = got[1000 * (i + 1)]
        assert np.array_equal(g["tokens"], s.token_ids)
        assert np.array_equal(g["positions"], np.arange(len(s.token_ids)))
        assert np.array_equal(g["target_mask"], s.loss_mask[1:].astype(np.float32))
        assert np.all(g["target_adv"] == i)
        assert np.array_equal(g["target_weight"], g["target_mask"])  # token_mean: weight 1 per sampled token
        assert np.array_equal(g["target_behav"], s.behavior_logprobs[1:])
        assert len(np.unique(g["seq_ids"])) == 1
    for mb in step.micro_batches:
        rows, bucket = mb.tokens.shape
        assert bucket in (16, 32, 64) and rows * bucket <= 128
        assert (mb.segment_ids.max(axis=1) <= 3).all()
        assert mb.loss_mask.shape == (rows, bucket - 1)
    # distinct sequences never share a seq id
    all_ids = [int(g["seq_ids"][0]) for g in got.values()]
    assert step.normaliser == sum(int(s.loss_mask.sum()) for s in seqs)
    assert step.stats["batch/tokens"] == sum(lengths)
    slots = sum(mb.tokens.size for mb in step.micro_batches)
    assert step.stats["batch/padding_frac"] == pytest.approx(1 - sum(lengths) / slots)
    assert len(all_ids) == len(seqs)


def test_seq_ids_are_unique_per_micro_batch() -> None:
    seqs = [_seq(4, 100 * i) for i in range(1, 20)]
    step = pack_step(seqs, buckets=[16], micro_batch_tokens=64, max_segments=4)
    for mb in step.micro_batches:
        ids = {}
        for r in range(mb.tokens.shape[0]):
            for t in range(mb.seq_ids.shape[1]):
                if mb.segment_ids[r, t + 1]:
                    ids.setdefault(int(mb.seq_ids[r, t]), set()).add((r, int(mb.segment_ids[r, t + 1])))
        assert all(len(v) == 1 for v in ids.values())
        assert max(ids) < mb.num_seqs


def test_overlong_truncate_and_drop_are_counted() -> None:
    seqs = [_seq(50, 1000), _seq(10, 2000), _seq(40, 3000, prompt=35)]
    trunc = pack_step(seqs, buckets=[16, 32], micro_batch_tokens=64, overlong="truncate")
    got = _unpack(trunc)
    assert np.array_equal(got[1000]["tokens"], np.arange(1000, 1032))
    assert 3000 not in got  # truncation left it with no sampled token
    assert trunc.stats["batch/overlong"] == 2 and trunc.stats["batch/dropped_sequences"] == 1
    drop = pack_step(seqs, buckets=[16, 32], micro_batch_tokens=64, overlong="drop")
    assert set(_unpack(drop)) == {2000}
    assert drop.stats["batch/dropped_sequences"] == 2


def test_row_multiple_and_seq_mean_weights() -> None:
    seqs = [_seq(6, 100 * i, prompt=i % 3 + 1) for i in range(1, 6)]
    step = pack_step(seqs, buckets=[8], micro_batch_tokens=40, row_multiple=2, aggregation="seq_mean_token_mean")
    assert all(mb.tokens.shape[0] % 2 == 0 for mb in step.micro_batches)
    assert step.normaliser == 5
    for g in _unpack(step).values():
        n = g["target_mask"].sum()
        np.testing.assert_allclose(g["target_weight"][g["target_mask"] > 0], 1 / n, rtol=1e-6)


def test_bad_inputs_give_clear_errors() -> None:
    with pytest.raises(ValueError, match="one length"):
        TrainSequence(np.arange(3), np.zeros(2, bool), np.zeros(3), 0.0)
    with pytest.raises(ValueError, match="finite and <= 0"):
        TrainSequence(np.arange(3), np.array([0, 1, 1], bool), np.array([0.0, -1.0, np.nan]), 0.0)
    with pytest.raises(ValueError, match="non-negative"):
        TrainSequence(np.array([1, -2, 3]), np.array([0, 1, 1], bool), np.zeros(3), 0.0)
    with pytest.raises(ValueError, match="first token"):
        TrainSequence(np.arange(3), np.ones(3, bool), np.zeros(3), 0.0)
    with pytest.raises(ValueError, match="micro_batch_tokens"):
        pack_step([_seq(4, 0)], buckets=[64], micro_batch_tokens=32)
    with pytest.raises(ValueError, match="no trainable"):
        pack_step([_seq(4, 0, prompt=4)], buckets=[8], micro_batch_tokens=32)
    with pytest.raises(KeyError, match="registered: constant, seq_mean_token_mean, token_mean"):
        pack_step([_seq(4, 0)], buckets=[8], micro_batch_tokens=32, aggregation="sum")


def test_a_small_step_gets_a_small_micro_batch() -> None:
    # Two short sequences at a 1,024-token budget of 64-token rows: one row, not 16.
    step = pack_step([_seq(20, 100), _seq(30, 200)], buckets=[32, 64], micro_batch_tokens=1024)
    assert [mb.tokens.shape for mb in step.micro_batches] == [(1, 64)]
    assert step.stats["batch/padding_frac"] == pytest.approx(1 - 50 / 64)
    fixed = pack_step([_seq(20, 100), _seq(30, 200)], buckets=[32, 64], micro_batch_tokens=1024, fit_rows=False)
    assert [mb.tokens.shape for mb in fixed.micro_batches] == [(16, 64)]
    assert _unpack(step).keys() == _unpack(fixed).keys() == {100, 200}


def test_row_counts_double_from_the_data_parallel_width_to_the_budget() -> None:
    assert row_counts(64, 1024, 1) == [1, 2, 4, 8, 16]
    assert row_counts(64, 1536, 2) == [2, 4, 8, 16, 24]
    assert row_counts(64, 128, 2) == [2]
    # A bucket's rows fill full micro-batches, and the rest takes the smallest count holding it.
    seqs = [_seq(60, 1000 * i) for i in range(1, 12)]
    step = pack_step(seqs, buckets=[64], micro_batch_tokens=512, row_multiple=2)
    assert [mb.tokens.shape[0] for mb in step.micro_batches] == [8, 4]
    assert [int((mb.segment_ids > 0).any(axis=1).sum()) for mb in step.micro_batches] == [8, 3]
