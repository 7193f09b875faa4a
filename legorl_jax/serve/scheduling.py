"""Host-side packing of one engine step: which tokens of which slot go in, in
which chunk bucket, and which KV blocks the step's attention window covers.
Pure functions of the slot list, kept apart from the engine's threading so
they can be tested on their own."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from legorl_jax.models.attention import KV_TILE
from legorl_jax.serve.blocks import NULL_BLOCK
from legorl_jax.serve.request_types import Slot
from legorl_jax.serve.step import StepInputs

_SEED_MOD = 2**32


def chunk_buckets(max_chunk: int, smallest: int = 1) -> tuple[int, ...]:
    """`smallest`, then x4 steps up to max_chunk (inclusive): few shapes, little padding."""
    if max_chunk < 1 or smallest < 1:
        raise ValueError(f"bucket bounds must be >= 1, got {smallest}..{max_chunk}")
    buckets = [min(smallest, max_chunk)]
    while buckets[-1] * 4 < max_chunk:
        buckets.append(buckets[-1] * 4)
    if buckets[-1] != max_chunk:
        buckets.append(max_chunk)
    return tuple(buckets)


def row_buckets(slots: int) -> tuple[int, ...]:
    """How many rows a step may run on: the slots it feeds, padded up to a
    bucket. 1, then x2: every row costs a full pass over the weights' matmuls
    (prefill chunks) and 8 agents must not pay for 16 rows, while a lone
    request (one long prompt, a single agent) pays for no padding rows."""
    if slots < 1:
        raise ValueError(f"slots must be >= 1, got {slots}")
    buckets = [1]
    while buckets[-1] * 2 < slots:
        buckets.append(buckets[-1] * 2)
    if buckets[-1] != slots:
        buckets.append(slots)
    return tuple(buckets)


def step_groups(slots: Sequence[Slot | None]) -> list[list[int]]:
    """Indices of the active slots, split into one device call for the slots
    that feed one token (decoding) and one for those still reading a prompt:
    a step pads every row to its longest chunk, so mixing them would make each
    decoding row cost a whole prefill chunk."""
    one: list[int] = []
    many: list[int] = []
    for i, slot in enumerate(slots):
        if slot is not None and len(slot.tokens) > slot.cached:
            (one if len(slot.tokens) - slot.cached == 1 else many).append(i)
    return [group for group in (one, many) if group]


# Smallest attention window in positions: below it a step costs little anyway,
# and fewer windows mean fewer compilations.
MIN_WINDOW = 256
# Up to WINDOW_STEP positions each window is at most a quarter over the one
# before: a decode step reads its whole window, so doubling made a 520-token
# batch read 1,024 positions a row. Past it windows grow WINDOW_STEP at a time,
# so a long prompt's chunks compile a few windows, not one per quarter.
WINDOW_GROWTH = 1.25
WINDOW_STEP = 4096


def window_buckets(max_blocks: int, block_size: int) -> tuple[int, ...]:
    """Attention windows in blocks: from MIN_WINDOW positions, each a quarter
    over the last up to WINDOW_STEP, then WINDOW_STEP at a time, up to
    max_blocks. A step attends over the smallest one holding its longest row,
    so its cost follows the live context."""
    step = max(1, WINDOW_STEP // block_size)
    buckets = [max(1, min(max_blocks, -(-MIN_WINDOW // block_size)))]
    while buckets[-1] < max_blocks:
        last = buckets[-1]
        grown = min(step, max(last + 1, math.ceil(last * WINDOW_GROWTH))) if last < step else last + step
        buckets.append(min(grown, max_blocks))
    return tuple(buckets)


def pick_bucket(needed: int, buckets: Sequence[int]) -> int:
    """Smallest bucket holding `needed` tokens; the largest when none does
    (the slot then feeds the rest of its prompt in later steps)."""
    return next((b for b in buckets if b >= needed), buckets[-1])


def build_inputs(
    slots: Sequence[Slot],
    chunks: Sequence[int],
    rows: Sequence[int],
    windows: Sequence[int],
    block_size: int,
    max_pairs: int | None = None,
) -> tuple[StepInputs, list[int]]:
    """Arrays for one step whose row r feeds slots[r] (later rows are padding),
    and how many tokens each slot feeds. `windows` are in blocks of `block_size`.

    max_pairs bounds rows x chunk x keys per attention tile (the window when
    smaller), the (query, key) pairs whose scores attention holds at once: the
    chunk shrinks to the largest bucket under it.
    """
    pending = [len(s.tokens) - s.cached for s in slots]
    n_slots = pick_bucket(max(len(slots), 1), rows)
    usable = [c for c in chunks if c <= pick_bucket(max(pending, default=1), chunks)]
    for chunk in reversed(usable):
        fed = [min(p, chunk) for p in pending]
        reach = max((s.cached + n for s, n in zip(slots, fed, strict=True)), default=1)
        window = pick_bucket(-(-reach // block_size), windows)
        if max_pairs is None or n_slots * chunk * min(window * block_size, KV_TILE) <= max_pairs:
            break
    tokens = np.zeros((n_slots, chunk), np.int32)
    positions = np.full((n_slots, chunk), -1, np.int32)
    targets = np.full((n_slots, chunk), -1, np.int32)
    block_table = np.full((n_slots, window), NULL_BLOCK, np.int32)
    last = np.zeros(n_slots, np.int32)
    temperature = np.ones(n_slots, np.float32)
    top_k = np.full(n_slots, -1, np.int32)
    top_p = np.ones(n_slots, np.float32)
    seeds = np.zeros(n_slots, np.uint32)
    counters = np.zeros(n_slots, np.int32)
    for row, slot in enumerate(slots):
        if fed[row] == 0:
            continue
        n, start = fed[row], slot.cached
        tokens[row, :n] = slot.tokens[start : start + n]
        positions[row, :n] = np.arange(start, start + n)
        following = slot.tokens[start + 1 : start + n + 1]
        targets[row, : len(following)] = following
        held = slot.blocks[:window]
        block_table[row, : len(held)] = held
        last[row] = n - 1
        params = slot.request.params
        temperature[row] = params.temperature
        top_k[row] = params.top_k
        top_p[row] = params.top_p
        seeds[row] = params.seed % _SEED_MOD
        counters[row] = slot.generated
    inputs = StepInputs(
        tokens=tokens,
        positions=positions,
        block_table=block_table,
        last=last,
        targets=targets,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seeds=seeds,
        counters=counters,
    )
    return inputs, fed
