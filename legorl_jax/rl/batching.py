"""From trajectory sequences to fixed-shape, packed micro-batches.

Sequences are packed first-fit-decreasing into rows no longer than the largest
length bucket; each row then takes the smallest bucket that holds it, and rows of
one bucket are cut into micro-batches of `micro_batch_tokens // bucket` rows
(rounded down to a multiple of the data-parallel width). Shapes therefore come
from a short list — one per bucket — and so do compilations.

Within a row, `segment_ids` (1.., 0 = padding) keep attention inside each
sequence and `positions` restart at 0 per sequence. The per-token training
arrays are shifted by one so that index t describes the token predicted at
t + 1: exactly the layout of `token_logprobs(model, tokens)`.

Overlong rule: with `overlong="truncate"` a sequence longer than the largest
bucket keeps its first `max(buckets)` tokens (the prompt and the start of the
completion; a suffix without its prompt would be meaningless); with "drop" it is
discarded. Either way it is counted, and a sequence left with no sampled token
is dropped.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from legorl_jax.rl.aggregation import aggregation_weights


@dataclass(frozen=True)
class TrainSequence:
    """One token sequence of a trajectory, with the advantage it is trained on."""

    token_ids: np.ndarray  # int32[L]
    loss_mask: np.ndarray  # bool[L]: True on engine-sampled tokens
    behavior_logprobs: np.ndarray  # float32[L]: engine logprob of each sampled token
    advantage: float
    policy_version: int = 0

    def __post_init__(self) -> None:
        lengths = {len(self.token_ids), len(self.loss_mask), len(self.behavior_logprobs)}
        if len(lengths) != 1:
            raise ValueError(
                "token_ids, loss_mask and behavior_logprobs must have one length, got "
                f"{len(self.token_ids)}, {len(self.loss_mask)}, {len(self.behavior_logprobs)}"
            )
        if len(self.token_ids) < 2:
            raise ValueError("a sequence needs at least 2 tokens (a context and a prediction)")
        if bool(np.asarray(self.loss_mask)[0]):
            raise ValueError("loss_mask[0] is set, but the first token has no context to predict it from")
        if not np.isfinite(self.advantage):
            raise ValueError(f"advantage must be finite, got {self.advantage}")
        sampled = np.asarray(self.behavior_logprobs)[np.asarray(self.loss_mask, dtype=bool)]
        if not np.all(np.isfinite(sampled)) or np.any(sampled > 0):
            raise ValueError("behavior_logprobs of sampled tokens must be finite and <= 0")
        if np.any(np.asarray(self.token_ids) < 0):
            raise ValueError("token_ids must be non-negative")


@dataclass(frozen=True)
class MicroBatch:
    """Model inputs [R, T] and loss inputs [R, T-1] for one accumulation step."""

    tokens: np.ndarray  # int32[R, T]
    positions: np.ndarray  # int32[R, T]
    segment_ids: np.ndarray  # int32[R, T]
    loss_mask: np.ndarray  # float32[R, T-1]
    behavior_logprobs: np.ndarray  # float32[R, T-1]
    advantages: np.ndarray  # float32[R, T-1]
    loss_weight: np.ndarray  # float32[R, T-1]: aggregation weight (0 off the mask)
    seq_ids: np.ndarray  # int32[R, T-1]: row * max_segments + segment - 1
    max_segments: int

    @property
    def num_seqs(self) -> int:
        """Static bound on sequences: rows × max segments per row."""
        return self.tokens.shape[0] * self.max_segments


@dataclass(frozen=True)
class PackedStep:
    micro_batches: list[MicroBatch]
    normaliser: float  # divide the summed weighted loss (and its gradient) by this once
    stats: dict[str, float] = field(default_factory=dict)


@dataclass
class _Row:
    members: list[int] = field(default_factory=list)
    used: int = 0


def _fit_length(seq: TrainSequence, max_len: int, overlong: str) -> int | None:
    """Kept length of a sequence under the overlong rule; None when dropped."""
    n = len(seq.token_ids)
    if n > max_len:
        if overlong == "drop":
            return None
        n = max_len
    return n if np.asarray(seq.loss_mask[:n]).any() else None


def _first_fit(lengths: list[int], capacity: int, max_segments: int) -> list[_Row]:
    rows: list[_Row] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        row = next(
            (r for r in rows if r.used + lengths[i] <= capacity and len(r.members) < max_segments), None
        )
        if row is None:
            row = _Row()
            rows.append(row)
        row.members.append(i)
        row.used += lengths[i]
    return rows


@dataclass(frozen=True)
class _Kept:
    """The step's surviving sequences, their kept lengths and aggregation weights."""

    seqs: list[TrainSequence]
    lengths: list[int]
    weights: np.ndarray


_ROW_ARRAYS = {"tokens": np.int32, "positions": np.int32, "segment_ids": np.int32}
_TARGET_ARRAYS = {
    "loss_mask": np.float32, "behavior_logprobs": np.float32, "advantages": np.float32,
    "loss_weight": np.float32, "seq_ids": np.int32,
}


def _fill_row(out: dict[str, np.ndarray], r: int, members: list[int], kept: _Kept, max_segments: int) -> None:
    start = 0
    for seg, i in enumerate(members, start=1):
        n, s = kept.lengths[i], kept.seqs[i]
        span = slice(start, start + n)
        mask = np.asarray(s.loss_mask[:n], dtype=np.float32)
        out["tokens"][r, span] = s.token_ids[:n]
        out["positions"][r, span] = np.arange(n)
        out["segment_ids"][r, span] = seg
        out["loss_mask"][r, span] = mask
        out["behavior_logprobs"][r, span] = np.where(mask > 0, s.behavior_logprobs[:n], 0.0)
        out["advantages"][r, span] = s.advantage
        out["loss_weight"][r, span] = mask * kept.weights[i]
        out["seq_ids"][r, span] = r * max_segments + seg - 1
        start += n


def _micro_batch(rows: list[_Row], n_rows: int, bucket: int, kept: _Kept, max_segments: int) -> MicroBatch:
    out = {k: np.zeros((n_rows, bucket), dtype) for k, dtype in {**_ROW_ARRAYS, **_TARGET_ARRAYS}.items()}
    for r, row in enumerate(rows):
        _fill_row(out, r, row.members, kept, max_segments)
    # Shift the per-token training arrays onto the predicted position.
    shifted = {k: out[k][:, 1:] for k in _TARGET_ARRAYS}
    return MicroBatch(**{k: out[k] for k in _ROW_ARRAYS}, **shifted, max_segments=max_segments)


def rows_per_micro_batch(bucket: int, micro_batch_tokens: int, row_multiple: int) -> int:
    rows = (micro_batch_tokens // bucket) // row_multiple * row_multiple
    if rows == 0:
        raise ValueError(
            f"micro_batch_tokens={micro_batch_tokens} holds no {row_multiple} row(s) of bucket {bucket}; "
            "raise learner.micro_batch_tokens or lower the largest length bucket"
        )
    return rows


def pack_step(
    seqs: list[TrainSequence],
    *,
    buckets: list[int],
    micro_batch_tokens: int,
    aggregation: str = "token_mean",
    overlong: Literal["truncate", "drop"] = "truncate",
    max_segments: int = 16,
    row_multiple: int = 1,
) -> PackedStep:
    """Packs one optimizer step's sequences into micro-batches.

    `row_multiple` is the data-parallel width (data × fsdp): every micro-batch
    has a multiple of it rows so the batch axis shards evenly.
    """
    buckets = sorted(set(buckets))
    if not buckets or buckets[0] < 2:
        raise ValueError(f"length buckets must be >= 2 tokens, got {buckets}")
    if overlong not in ("truncate", "drop"):
        raise ValueError(f"overlong must be 'truncate' or 'drop', got {overlong!r}")
    for b in buckets:
        rows_per_micro_batch(b, micro_batch_tokens, row_multiple)
    max_len = buckets[-1]
    fitted = [_fit_length(s, max_len, overlong) for s in seqs]
    kept = [i for i, n in enumerate(fitted) if n is not None]
    if not kept:
        raise ValueError(f"no trainable sequence among {len(seqs)} (all dropped or without sampled tokens)")
    kseqs = [seqs[i] for i in kept]
    lengths = [n for n in fitted if n is not None]
    loss_tokens = np.array([int(np.asarray(s.loss_mask[:n]).sum()) for s, n in zip(kseqs, lengths, strict=True)])
    weights, normaliser = aggregation_weights(aggregation, loss_tokens, float(max_len))
    layout = _Kept(kseqs, lengths, weights)

    by_bucket: dict[int, list[_Row]] = {}
    for row in _first_fit(lengths, max_len, max_segments):
        bucket = next(b for b in buckets if b >= row.used)
        by_bucket.setdefault(bucket, []).append(row)
    micro_batches = []
    for bucket in sorted(by_bucket):
        rows = by_bucket[bucket]
        per_mb = rows_per_micro_batch(bucket, micro_batch_tokens, row_multiple)
        for start in range(0, len(rows), per_mb):
            micro_batches.append(_micro_batch(rows[start : start + per_mb], per_mb, bucket, layout, max_segments))

    slots = sum(mb.tokens.size for mb in micro_batches)
    real = sum(lengths)
    n_over = sum(len(s.token_ids) > max_len for s in seqs)
    stats = {
        "batch/sequences": float(len(kseqs)),
        "batch/tokens": float(real),
        "batch/loss_tokens": float(loss_tokens.sum()),
        "batch/padding_frac": 1.0 - real / slots,
        "batch/micro_batches": float(len(micro_batches)),
        "batch/overlong": float(n_over),
        "batch/dropped_sequences": float(len(seqs) - len(kseqs)),
        "batch/policy_version_min": float(min(s.policy_version for s in kseqs)),
    }
    return PackedStep(micro_batches, normaliser, stats)
