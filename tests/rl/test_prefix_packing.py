"""Prefix-shared packing: each shared prompt prefix laid out once, every sequence
recoverable from its prefix chain, loss tokens never shared, tries split to fit."""

from __future__ import annotations

import numpy as np

from legorl_jax.rl.batching import MicroBatch, PackedStep, TrainSequence, pack_step


def _seq(prompt: np.ndarray, completion: np.ndarray, adv: float) -> TrainSequence:
    tokens = np.concatenate([prompt, completion]).astype(np.int32)
    mask = np.arange(len(tokens)) >= len(prompt)
    return TrainSequence(tokens, mask, np.where(mask, -0.5, 0.0).astype(np.float32), adv)


def _group(prompt_len: int, members: int, tail: int, first: int) -> list[TrainSequence]:
    prompt = np.arange(first, first + prompt_len)
    return [_seq(prompt, np.full(tail, 1000 + m), float(m)) for m in range(members)]


def _visible(mb: MicroBatch, r: int, q: int) -> np.ndarray:
    """Row indices query q attends to: the mask the model builds from these arrays."""
    s = np.arange(q + 1)
    same = mb.segment_ids[r, s] == mb.segment_ids[r, q]
    inside = q < mb.kv_end[r, s] if mb.tree else True
    return s[same & inside]


def _sequences(step: PackedStep) -> dict[int, dict]:
    """Each sequence read back from its last target: its visible chain of tokens, keyed by seq id."""
    out = {}
    for m, mb in enumerate(step.micro_batches):
        for sid in np.unique(mb.seq_ids[mb.loss_mask > 0]):
            r, j = np.argwhere((mb.seq_ids == sid) & (mb.loss_mask > 0))[-1]
            chain = _visible(mb, r, j + 1)
            targets = np.flatnonzero((mb.seq_ids[r] == sid) & (mb.loss_mask[r] > 0))
            pred = mb.pred_from[r, targets] if mb.tree else targets
            out[(m, int(sid))] = {
                "tokens": mb.tokens[r, chain],
                "positions": mb.positions[r, chain],
                "adv": float(mb.advantages[r, targets[0]]),
                # each target is predicted from the token before it in its own chain
                "pred_ok": all(
                    p in chain and chain[list(chain).index(p) + 1] == t + 1 for p, t in zip(pred, targets, strict=True)
                ),
            }
    return out


def test_a_group_shares_its_prompt_once_and_each_member_reads_back_whole() -> None:
    seqs = _group(40, 8, 6, first=0) + _group(30, 4, 5, first=200)
    step = pack_step(seqs, buckets=[128], micro_batch_tokens=256)
    assert step.stats["batch/computed_tokens"] == 40 + 8 * 6 + 30 + 4 * 5
    assert step.stats["batch/shared_token_frac"] == 1 - step.stats["batch/computed_tokens"] / sum(
        len(s.token_ids) for s in seqs
    )
    found = _sequences(step)
    assert len(found) == len(seqs)
    by_adv_and_len = {(s.advantage, len(s.token_ids), int(s.token_ids[0])): s for s in seqs}
    for got in found.values():
        want = by_adv_and_len[(got["adv"], len(got["tokens"]), int(got["tokens"][0]))]
        np.testing.assert_array_equal(got["tokens"], want.token_ids)
        np.testing.assert_array_equal(got["positions"], np.arange(len(want.token_ids)))
        assert got["pred_ok"]


def test_sharing_stops_at_the_first_sampled_token() -> None:
    # Identical members: prompt and completion alike. Only the prompt may be shared.
    seqs = [_seq(np.arange(20), np.arange(50, 60), float(a)) for a in (1.0, -1.0, 0.5)]
    step = pack_step(seqs, buckets=[64], micro_batch_tokens=64)
    assert step.stats["batch/computed_tokens"] == 20 + 3 * 10
    mb = step.micro_batches[0]
    assert mb.loss_mask.sum() == 30 and sorted(set(mb.advantages[mb.loss_mask > 0])) == [-1.0, 0.5, 1.0]


def test_a_trie_too_big_for_a_row_is_split_with_the_prefix_copied() -> None:
    seqs = _group(40, 8, 20, first=0)  # 40 + 8 × 20 = 200 tokens shared, rows of 128
    step = pack_step(seqs, buckets=[128], micro_batch_tokens=128, max_segments=3)
    per_row = [
        np.unique(mb.seq_ids[r][mb.loss_mask[r] > 0]).size
        for mb in step.micro_batches
        for r in range(mb.tokens.shape[0])
    ]
    assert max(per_row) <= 3 and sum(per_row) == 8
    assert step.stats["batch/computed_tokens"] == len(per_row) * 40 + 8 * 20
    assert len(_sequences(step)) == 8


def test_sharing_switched_off_packs_every_sequence_whole() -> None:
    seqs = _group(40, 4, 6, first=0)
    step = pack_step(seqs, buckets=[64], micro_batch_tokens=128, share_prefixes=False)
    assert step.stats["batch/shared_token_frac"] == 0.0
    assert not any(mb.tree for mb in step.micro_batches)
    assert step.stats["batch/computed_tokens"] == step.stats["batch/tokens"] == 4 * 46
