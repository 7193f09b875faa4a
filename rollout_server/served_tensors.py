"""The served version's tensors kept in host memory, so that a delta patches
them instead of reading the served directory back from disk.

`ServedTensors` holds at most one version: the directory it is installed as,
its digest, its tensors and each tensor's part of the digest (`tensor_sum`).
A delta `take`s them, patches them in place, rehashes only the tensors it
changed and, once the new version is installed and its digest checked,
`hold`s them again. Whatever fails in between leaves nothing held, so the
next delta reads the served directory from disk: the copy in memory is only
ever used as the exact version it was checked to be.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np


@dataclasses.dataclass(frozen=True)
class Held:
    """One version's tensors as checked against `digest`, with each tensor's `tensor_sum`."""

    directory: Path
    digest: str
    tensors: dict[str, np.ndarray]
    sums: dict[str, bytes]


class ServedTensors:
    def __init__(self) -> None:
        self._held: Held | None = None

    def take(self, directory: Path, digest: str) -> Held | None:
        """The held tensors if they are `directory`'s at `digest`; either way nothing
        stays held (the caller patches them in place, or they are stale)."""
        held, self._held = self._held, None
        if held is None or (held.directory, held.digest) != (directory, digest):
            return None
        return held

    def hold(self, held: Held) -> None:
        """Keeps `held`, which the caller has checked against its digest."""
        self._held = held

    def clear(self) -> None:
        self._held = None
