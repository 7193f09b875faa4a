"""From trajectory sequences to fixed-shape, packed micro-batches.

Sequences are packed first-fit-decreasing into rows no longer than the largest
length bucket; each row then takes the smallest bucket that holds it, and rows of
one bucket are cut into micro-batches of at most `micro_batch_tokens // bucket`
rows (rounded down to a multiple of the data-parallel width). A micro-batch with
fewer rows than that (a small step, a bucket's last one) takes the smallest row
count of `row_counts` that holds them: the data-parallel width times a power of
two, or the full count. So a small step computes little padding (at most twice
its rows), while shapes still come from a short fixed list — per bucket, about
log2(full rows) + 1 row counts — and so do compilations.

Within a row, `segment_ids` (1.., 0 = padding) keep attention inside each
sequence and `positions` restart at 0 per sequence. The per-token training
arrays are shifted by one so that index t describes the token predicted at
t + 1: exactly the layout of `token_logprobs(model, tokens)`. A packed step
remembers where each sequence landed (`places`), so per-target results such as
the learner's logprobs map back to each sequence's own tokens (`per_sequence`).
`score_index` lists each row's loss targets so the learner computes the LM
head only there (a coding agent's episode is mostly prompt); its width comes
from a power-of-two ladder, or it is None when nearly every target is scored.

Prefix sharing (`share_prefixes`): sequences whose prompts start alike (a
group's members, groups of one harness configuration) are laid out as a trie,
each shared prefix once and every continuation after it in depth-first order,
with positions continuing from the prefix. Only prompt tokens are shared (a
prefix ends at or before each member's first sampled token), so every loss
token stays its own sequence's and the loss is exactly the unshared one. Such
a micro-batch carries two more arrays: `kv_end` (a key is seen by the queries
before its subtree ends: its own prefix chain, nothing else) and `pred_from`
(the row index whose hidden state predicts each target: a branch's first token
is predicted from the shared prefix's last token). A trie too big for one row
is split, each part with its own copy of the prefix path.

Overlong rule: with `overlong="truncate"` a sequence longer than the largest
bucket keeps its first `max(buckets)` tokens (the prompt and the start of the
completion; a suffix without its prompt would be meaningless); with "drop" it is
discarded. Either way it is counted, and a sequence left with no sampled token
is dropped.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
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
    policy_version: int = 0  # the oldest version that sampled into it
    # int64[L]: the policy version whose logprob each sampled token's behaviour logprob is
    # (-1 off the mask); None: every sampled token is `policy_version`'s.
    token_versions: np.ndarray | None = None

    def __post_init__(self) -> None:
        lengths = {len(self.token_ids), len(self.loss_mask), len(self.behavior_logprobs)}
        if self.token_versions is not None and len(self.token_versions) != len(self.token_ids):
            raise ValueError(f"token_versions has {len(self.token_versions)} entries for {len(self.token_ids)} tokens")
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
    seq_ids: np.ndarray  # int32[R, T-1]: row * max_segments + sequence index in the row
    max_segments: int
    # Tree rows only (None when nothing in the micro-batch is shared):
    kv_end: np.ndarray | None = None  # int32[R, T]: key s is visible to queries q with s <= q < kv_end[s]
    pred_from: np.ndarray | None = None  # int32[R, T-1]: row index whose hidden state predicts target t
    # int32[R, S]: each row's targets with loss_mask > 0, padded with T-1 (out of range); S comes from
    # `score_capacity`. None: score every target (S would be close to T-1 anyway).
    score_index: np.ndarray | None = None

    @property
    def tree(self) -> bool:
        return self.kv_end is not None

    @property
    def num_seqs(self) -> int:
        """Static bound on sequences: rows × max segments per row."""
        return self.tokens.shape[0] * self.max_segments


@dataclass(frozen=True)
class TokenPlace:
    """Where a sequence's trained tokens sit: its tokens [first, stop) fill row
    `row` of micro-batch `micro_batch` from (unshifted) column `col` on."""

    micro_batch: int
    row: int
    col: int
    first: int
    stop: int
    length: int  # the whole sequence's, before any truncation


@dataclass(frozen=True)
class PackedStep:
    micro_batches: list[MicroBatch]
    normaliser: float  # divide the summed weighted loss (and its gradient) by this once
    stats: dict[str, float] = field(default_factory=dict)
    places: list[TokenPlace | None] = field(default_factory=list)  # per input sequence; None: dropped

    def per_sequence(self, targets: list[np.ndarray]) -> list[np.ndarray | None]:
        """Per-target arrays of the micro-batches ([R, T-1] each, e.g. the learner's
        logprobs) back in each input sequence's token order: float32[L], NaN on
        every token not trained (context, a truncated tail); None for a dropped sequence."""
        out: list[np.ndarray | None] = []
        for place in self.places:
            if place is None:
                out.append(None)
                continue
            # Target t of a row describes the token at column t + 1; a row's first token has none.
            skip = 1 if place.col == 0 else 0
            first, col = place.first + skip, place.col + skip
            span = (place.row, slice(col - 1, col - 1 + place.stop - first))
            trained = self.micro_batches[place.micro_batch].loss_mask[span] > 0
            values = np.full(place.length, np.nan, np.float32)
            values[first : place.stop] = np.where(trained, targets[place.micro_batch][span], np.nan)
            out.append(values)
        return out


@dataclass
class _Row:
    members: list[int] = field(default_factory=list)
    used: int = 0
    sequences: int = 0


@dataclass
class _Node:
    """A run of tokens in a packing trie: a shared prefix (seq None) or a sequence's own tail (a leaf)."""

    tokens: np.ndarray
    depth: int  # position of the first token: the length of the prefix above it
    seq: int | None = None
    children: list[_Node] = field(default_factory=list)

    @property
    def size(self) -> int:
        return len(self.tokens) + sum(c.size for c in self.children)

    @property
    def leaves(self) -> int:
        return 1 if self.seq is not None else sum(c.leaves for c in self.children)

    @property
    def branches(self) -> bool:
        return len(self.children) > 1 or any(c.branches for c in self.children)


def _fit_length(seq: TrainSequence, max_len: int, overlong: str) -> int | None:
    """Kept length of a sequence under the overlong rule; None when dropped."""
    n = len(seq.token_ids)
    if n > max_len:
        if overlong == "drop":
            return None
        n = max_len
    return n if np.asarray(seq.loss_mask[:n]).any() else None


def _first_fit(lengths: list[int], counts: list[int], capacity: int, max_segments: int) -> list[_Row]:
    """First-fit decreasing of items (length, sequences) into rows of `capacity` tokens."""
    rows: list[_Row] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        row = next(
            (r for r in rows if r.used + lengths[i] <= capacity and r.sequences + counts[i] <= max_segments), None
        )
        if row is None:
            row = _Row()
            rows.append(row)
        row.members.append(i)
        row.used += lengths[i]
        row.sequences += counts[i]
    return rows


@dataclass(frozen=True)
class _Kept:
    """The step's surviving sequences, their kept lengths and aggregation weights."""

    seqs: list[TrainSequence]
    lengths: list[int]
    weights: np.ndarray


def _leaf(kept: _Kept, i: int, depth: int) -> _Node:
    """Sequence i from token `depth` on: its own tail below a shared prefix (the whole of it at 0)."""
    return _Node(np.asarray(kept.seqs[i].token_ids[depth : kept.lengths[i]]), depth, seq=i)


def _first_sampled(seq: TrainSequence) -> int:
    return int(np.argmax(seq.loss_mask))


def _trie(kept: _Kept, members: list[int], depth: int) -> list[_Node]:
    """Nodes below a prefix of `depth` tokens that `members` share.

    A sequence's sharable part ends at its first sampled token; past it, or
    alone, it is a leaf holding the rest of the sequence.
    """
    nodes: list[_Node] = []
    by_next: dict[int, list[int]] = {}
    for i in members:
        if _first_sampled(kept.seqs[i]) > depth:
            by_next.setdefault(int(kept.seqs[i].token_ids[depth]), []).append(i)
        else:
            nodes.append(_leaf(kept, i, depth))
    for group in by_next.values():
        if len(group) == 1:
            nodes.append(_leaf(kept, group[0], depth))
            continue
        limit = min(_first_sampled(kept.seqs[i]) for i in group)
        block = np.stack([np.asarray(kept.seqs[i].token_ids[depth:limit]) for i in group])
        differs = np.any(block != block[0], axis=0)
        end = depth + (int(np.argmax(differs)) if differs.any() else limit - depth)
        nodes.append(_Node(block[0, : end - depth], depth, children=_trie(kept, group, end)))
    return nodes


def _chain(path: list[_Node], children: list[_Node]) -> _Node:
    """A copy of the prefix path `path` (root first) holding `children` under its last node."""
    for node in reversed(path):
        children = [_Node(node.tokens, node.depth, children=children)]
    return children[0]


def _units(node: _Node, path: list[_Node], capacity: int, max_segments: int) -> list[_Node]:
    """Splits a trie into parts that each fit a row: a part that fits stays whole;
    otherwise its children are binned, each bin under its own copy of the path."""
    if node.depth + node.size <= capacity and node.leaves <= max_segments:
        return [_chain(path, [node])]
    inner, room = [*path, node], capacity - node.depth - len(node.tokens)
    fitting, units = [], []
    for child in node.children:
        if child.size <= room and child.leaves <= max_segments:
            fitting.append(child)
        else:
            units.extend(_units(child, inner, capacity, max_segments))
    bins = _first_fit([c.size for c in fitting], [c.leaves for c in fitting], room, max_segments)
    units.extend(_chain(inner, [fitting[i] for i in b.members]) for b in bins)
    return units


def _layout(kept: _Kept, share: bool, capacity: int, max_segments: int) -> list[_Node]:
    """The step's packable units: whole sequences, or (sharing) tries that fit a row."""
    everyone = list(range(len(kept.seqs)))
    if not share:
        return [_leaf(kept, i, 0) for i in everyone]
    return [u for root in _trie(kept, everyone, 0) for u in _units(root, [], capacity, max_segments)]


# (row, column, first, stop) of a kept sequence within its micro-batch
_Where = tuple[int, int, int, int]
_ROW_ARRAYS = {"tokens": np.int32, "positions": np.int32, "segment_ids": np.int32, "kv_end": np.int32}
_TARGET_ARRAYS = {
    "loss_mask": np.float32,
    "behavior_logprobs": np.float32,
    "advantages": np.float32,
    "loss_weight": np.float32,
    "seq_ids": np.int32,
    "pred_from": np.int32,
}


class _RowWriter:
    """Writes units depth-first into one row of a micro-batch's (unshifted) arrays."""

    def __init__(
        self, out: dict[str, np.ndarray], r: int, kept: _Kept, max_segments: int, places: dict[int, _Where]
    ) -> None:
        self.out, self.r, self.kept, self.max_segments, self.places = out, r, kept, max_segments, places
        self.cursor = 0
        self.sequences = 0

    def unit(self, node: _Node, segment: int) -> None:
        self._node(node, segment, parent_last=self.cursor - 1)

    def _node(self, node: _Node, segment: int, parent_last: int) -> None:
        out, r, n = self.out, self.r, len(node.tokens)
        start = self.cursor
        span = slice(start, start + n)
        out["tokens"][r, span] = node.tokens
        out["positions"][r, span] = node.depth + np.arange(n)
        out["segment_ids"][r, span] = segment
        # Each token is predicted by the one before it; a node's first token by its parent's last.
        out["pred_from"][r, span] = np.arange(start - 1, start + n - 1)
        out["pred_from"][r, start] = parent_last
        self.cursor += n
        if node.seq is not None:
            self._loss(node, span)
        for child in node.children:
            self._node(child, segment, parent_last=start + n - 1)
        out["kv_end"][r, span] = self.cursor  # a token is seen only inside its own subtree

    def _loss(self, leaf: _Node, span: slice) -> None:
        out, r = self.out, self.r
        i = leaf.seq
        assert i is not None
        s, stop = self.kept.seqs[i], leaf.depth + len(leaf.tokens)
        mask = np.asarray(s.loss_mask[leaf.depth : stop], dtype=np.float32)
        out["loss_mask"][r, span] = mask
        out["behavior_logprobs"][r, span] = np.where(mask > 0, s.behavior_logprobs[leaf.depth : stop], 0.0)
        out["advantages"][r, span] = s.advantage
        out["loss_weight"][r, span] = mask * self.kept.weights[i]
        out["seq_ids"][r, span] = r * self.max_segments + self.sequences
        self.places[i] = (r, span.start, leaf.depth, stop)
        self.sequences += 1


def _micro_batch(
    rows: list[_Row],
    n_rows: int,
    bucket: int,
    units: list[_Node],
    kept: _Kept,
    max_segments: int,
    places: dict[int, _Where],
) -> MicroBatch:
    """The micro-batch of `rows`; `places` gets (row, column, first, stop) of each kept sequence in it."""
    out = {k: np.zeros((n_rows, bucket), dtype) for k, dtype in {**_ROW_ARRAYS, **_TARGET_ARRAYS}.items()}
    # Padding sees all padding before it (segment 0), and predicts from its left neighbour.
    out["kv_end"][:] = bucket
    out["pred_from"][:] = np.arange(-1, bucket - 1)
    for r, row in enumerate(rows):
        writer = _RowWriter(out, r, kept, max_segments, places)
        for segment, u in enumerate(row.members, start=1):
            writer.unit(units[u], segment)
    # Shift the per-token training arrays onto the predicted position.
    shifted = {k: out[k][:, 1:] for k in _TARGET_ARRAYS}
    tree = any(units[u].branches for row in rows for u in row.members)
    batch = MicroBatch(
        **{k: out[k] for k in _ROW_ARRAYS},
        **shifted,
        max_segments=max_segments,
        score_index=scored_targets(shifted["loss_mask"]),
    )
    # Without branches the tree arrays say what segment ids and the shift already say.
    return batch if tree else replace(batch, kv_end=None, pred_from=None)


# Fewest scored positions per row: a smaller capacity saves little and adds a compilation.
MIN_SCORED = 128


def score_capacity(scored: int, targets: int) -> int | None:
    """Static per-row count of scored targets for a row holding at most `scored` of `targets`:
    a power of two from `MIN_SCORED` up, so each bucket adds a few shapes (and compilations) at
    most. None (score all) when it would reach 3/4 of the targets: the gathers would save little."""
    capacity = max(MIN_SCORED, 1 << max(scored - 1, 0).bit_length())
    return capacity if 4 * capacity < 3 * targets else None


def scored_targets(loss_mask: np.ndarray) -> np.ndarray | None:
    """int32[R, S]: the targets with loss_mask > 0 of each row, padded with T-1 (see `MicroBatch`)."""
    n_rows, targets = loss_mask.shape
    scored = loss_mask > 0
    capacity = score_capacity(int(scored.sum(axis=1).max(initial=0)), targets)
    if capacity is None:
        return None
    out = np.full((n_rows, capacity), targets, np.int32)
    for r in range(n_rows):
        where = np.flatnonzero(scored[r])
        out[r, : len(where)] = where
    return out


def rows_per_micro_batch(bucket: int, micro_batch_tokens: int, row_multiple: int) -> int:
    rows = (micro_batch_tokens // bucket) // row_multiple * row_multiple
    if rows == 0:
        raise ValueError(
            f"micro_batch_tokens={micro_batch_tokens} holds no {row_multiple} row(s) of bucket {bucket}; "
            "raise learner.micro_batch_tokens or lower the largest length bucket"
        )
    return rows


def row_counts(bucket: int, micro_batch_tokens: int, row_multiple: int) -> list[int]:
    """The row counts a micro-batch of `bucket` may have, ascending: `row_multiple` times
    1, 2, 4, … below the budget's full count, then the full count. Doubling keeps the list
    (and the compiled programs) logarithmic in the budget while padding at most doubles rows."""
    full = rows_per_micro_batch(bucket, micro_batch_tokens, row_multiple)
    counts = []
    n = row_multiple
    while n < full:
        counts.append(n)
        n *= 2
    return [*counts, full]


def pack_step(
    seqs: list[TrainSequence],
    *,
    buckets: list[int],
    micro_batch_tokens: int,
    aggregation: str = "token_mean",
    overlong: Literal["truncate", "drop"] = "truncate",
    max_segments: int = 16,
    row_multiple: int = 1,
    share_prefixes: bool = True,
    fit_rows: bool = True,
) -> PackedStep:
    """Packs one optimizer step's sequences into micro-batches.

    `row_multiple` is the data-parallel width (data × fsdp): every micro-batch
    has a multiple of it rows so the batch axis shards evenly. `max_segments`
    bounds the sequences of one row; `share_prefixes` lays out common prompt
    prefixes once (module docstring). `fit_rows=False` gives every micro-batch
    the budget's full row count, padding a small step to it: the fixed-shape
    layout, kept as the benchmarks' baseline.
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

    units = _layout(layout, share_prefixes, max_len, max_segments)
    by_bucket: dict[int, list[_Row]] = {}
    for row in _first_fit([u.size for u in units], [u.leaves for u in units], max_len, max_segments):
        bucket = next(b for b in buckets if b >= row.used)
        by_bucket.setdefault(bucket, []).append(row)
    micro_batches = []
    places: list[TokenPlace | None] = [None] * len(seqs)
    for bucket in sorted(by_bucket):
        rows = by_bucket[bucket]
        counts = row_counts(bucket, micro_batch_tokens, row_multiple)
        if not fit_rows:
            counts = counts[-1:]
        for start in range(0, len(rows), counts[-1]):
            part = rows[start : start + counts[-1]]
            n_rows = next(n for n in counts if n >= len(part))
            found: dict[int, _Where] = {}
            micro_batches.append(_micro_batch(part, n_rows, bucket, units, layout, max_segments, found))
            for k, where in found.items():
                places[kept[k]] = TokenPlace(len(micro_batches) - 1, *where, length=len(seqs[kept[k]].token_ids))

    slots = sum(mb.tokens.size for mb in micro_batches)
    real = sum(lengths)
    computed = sum(u.size for u in units)
    n_over = sum(len(s.token_ids) > max_len for s in seqs)
    stats = {
        "batch/sequences": float(len(kseqs)),
        "batch/tokens": float(real),
        "batch/loss_tokens": float(loss_tokens.sum()),
        "batch/computed_tokens": float(computed),
        "batch/shared_token_frac": 1.0 - computed / real,
        "batch/padding_frac": 1.0 - computed / slots,
        "batch/micro_batches": float(len(micro_batches)),
        "batch/overlong": float(n_over),
        "batch/dropped_sequences": float(len(seqs) - len(kseqs)),
        "batch/policy_version_min": float(min(s.policy_version for s in kseqs)),
    }
    return PackedStep(micro_batches, normaliser, stats, places)
