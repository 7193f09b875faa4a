"""`MicroBatch.score_index`: every loss target of each row, in a static width from a coarse ladder."""

from __future__ import annotations

import numpy as np
import pytest

from legorl_jax.rl.batching import MIN_SCORED, TrainSequence, pack_step, score_capacity


def _seq(length: int, prompt: int, seed: int) -> TrainSequence:
    mask = np.arange(length) >= prompt
    ids = np.random.default_rng(seed).integers(0, 1000, length).astype(np.int32)
    return TrainSequence(ids, mask, np.where(mask, -0.5, 0.0).astype(np.float32), 1.0)


@pytest.mark.parametrize("share", [False, True])
def test_score_index_lists_exactly_the_loss_targets(share: bool) -> None:
    # Long prompts, short completions: a coding agent's shape.
    seqs = [_seq(n, n - k, seed=i) for i, (n, k) in enumerate([(300, 20), (500, 7), (250, 60), (900, 130), (40, 39)])]
    step = pack_step(seqs, buckets=[512, 1024], micro_batch_tokens=2048, share_prefixes=share)
    for mb in step.micro_batches:
        assert mb.score_index is not None
        targets = mb.loss_mask.shape[1]
        capacity = mb.score_index.shape[1]
        assert capacity >= MIN_SCORED and capacity & (capacity - 1) == 0
        for r in range(mb.tokens.shape[0]):
            scored = np.flatnonzero(mb.loss_mask[r] > 0)
            assert np.array_equal(mb.score_index[r, : len(scored)], scored)
            assert np.all(mb.score_index[r, len(scored) :] == targets)  # padding: out of range


def test_a_row_scored_almost_everywhere_scores_all() -> None:
    step = pack_step([_seq(1000, 1, seed=0)], buckets=[1024], micro_batch_tokens=1024)
    assert step.micro_batches[0].score_index is None


def test_capacity_ladder() -> None:
    assert score_capacity(0, 1023) == MIN_SCORED
    assert score_capacity(MIN_SCORED, 1023) == MIN_SCORED
    assert score_capacity(MIN_SCORED + 1, 1023) == 2 * MIN_SCORED
    assert score_capacity(500, 1023) == 512
    assert score_capacity(600, 1023) is None  # 1,024 slots for 1,023 targets: the full path
    assert score_capacity(10, 127) is None  # a short bucket is scored in full
    assert score_capacity(5000, 12287) == 8192
    assert score_capacity(9000, 12287) is None
