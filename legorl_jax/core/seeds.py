"""Seeds derived from a base seed and a place: a run's groups from the run's seed,
a trial's from its group's, a model call's from its trial's. Same seed, same place,
same samples; no two places share one."""

from __future__ import annotations

import hashlib


def derive_seed(base: int, *place: object) -> int:
    """A stable hash of `base` and `place` (e.g. ("train", step, round, index)): 63 bits,
    within every engine's signed 64-bit seed, and never 0, which means unseeded in
    `SamplingParams.seed`. Not Python's `hash()`, which changes from process to process."""
    parts = "/".join(map(str, (base, *place))).encode()
    return int.from_bytes(hashlib.blake2b(parts, digest_size=8).digest(), "big") >> 1 or 1
