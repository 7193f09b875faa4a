"""Host-side packing of one engine step: which tokens of which slot go in, in
which chunk bucket. Pure functions of the slot list, kept apart from the
engine's threading so they can be tested on their own."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal

import numpy as np

from legorl_jax.serve.step import StepInputs

if TYPE_CHECKING:
    from legorl_jax.serve.engine import Slot

PauseMode = Literal["abort", "wait", "keep"]

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
    """How many leading cache rows a step may run on. Requests take the lowest
    free slot, so a light load runs on a few rows instead of all of them; the
    floor of 4 keeps the number of compiled shapes small."""
    return chunk_buckets(slots, smallest=4)


def pick_bucket(needed: int, buckets: Sequence[int]) -> int:
    """Smallest bucket holding `needed` tokens; the largest when none does
    (the slot then feeds the rest of its prompt in later steps)."""
    return next((b for b in buckets if b >= needed), buckets[-1])


def build_inputs(
    slots: Sequence[Slot | None], chunks: Sequence[int], rows: Sequence[int]
) -> tuple[StepInputs, list[int]]:
    """Arrays for one step over the leading rows that hold every active slot,
    and how many tokens each slot feeds."""
    pending = [0 if s is None else len(s.tokens) - s.cached for s in slots]
    chunk = pick_bucket(max(pending, default=1), chunks)
    last_active = max((i for i, s in enumerate(slots) if s is not None), default=0)
    n_slots = pick_bucket(last_active + 1, rows)
    slots = slots[:n_slots]
    tokens = np.zeros((n_slots, chunk), np.int32)
    positions = np.full((n_slots, chunk), -1, np.int32)
    targets = np.full((n_slots, chunk), -1, np.int32)
    last = np.zeros(n_slots, np.int32)
    temperature = np.ones(n_slots, np.float32)
    top_k = np.full(n_slots, -1, np.int32)
    top_p = np.ones(n_slots, np.float32)
    seeds = np.zeros(n_slots, np.uint32)
    counters = np.zeros(n_slots, np.int32)
    fed = [min(p, chunk) for p in pending]
    for row, slot in enumerate(slots):
        if slot is None or fed[row] == 0:
            continue
        n, start = fed[row], slot.cached
        tokens[row, :n] = slot.tokens[start : start + n]
        positions[row, :n] = np.arange(start, start + n)
        following = slot.tokens[start + 1 : start + n + 1]
        targets[row, : len(following)] = following
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
        last=last,
        targets=targets,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seeds=seeds,
        counters=counters,
    )
    return inputs, fed
