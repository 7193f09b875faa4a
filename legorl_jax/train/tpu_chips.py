"""TPU generations as `legorl plan` needs them: published per-chip peaks, and
slice names turned into the topologies libtpu compiles for.

Peaks are Google Cloud's published figures per chip (bf16 dense FLOP/s, HBM
capacity and bandwidth), from the system-architecture page of each generation:
https://cloud.google.com/tpu/docs/v4, .../v5e, .../v5p, .../v6e (read 2026-12).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

GIB = 2**30


@dataclass(frozen=True)
class Chip:
    generation: str  # as libtpu names it in a topology: v4, v5e, v5p, v6e
    bf16_flops: float  # peak dense bf16 FLOP/s per chip
    hbm_bytes: int  # HBM per chip
    hbm_bandwidth: float  # bytes/s per chip
    dims: int  # topology dimensions (3: a torus of chips, 2: a 2D slice)
    cores_per_chip_in_name: int  # how a slice name counts: TensorCores (v4, v5p) or chips


CHIPS = {
    "v4": Chip("v4", 275e12, 32 * GIB, 1200e9, 3, 2),
    "v5e": Chip("v5e", 197e12, 16 * GIB, 819e9, 2, 1),
    "v5p": Chip("v5p", 459e12, 95 * GIB, 2765e9, 3, 2),
    "v6e": Chip("v6e", 918e12, 32 * GIB, 1640e9, 2, 1),
}


@dataclass(frozen=True)
class Topology:
    chip: Chip
    shape: tuple[int, ...]  # chips along each axis

    @property
    def name(self) -> str:
        return f"{self.chip.generation}:{'x'.join(map(str, self.shape))}"

    @property
    def chips(self) -> int:
        return math.prod(self.shape)


def _grid(chips: int, dims: int) -> tuple[int, ...]:
    """The standard slice of `chips` chips: axes doubled in the order x, y, (z), then
    back from the last axis (v5p: 2x2x1, 2x2x2, 2x2x4, 2x4x4, 4x4x4; v6e: 2x2, 2x4,
    4x4, 4x8, 8x8), as Cloud TPU lays its slices out."""
    if chips < 1 or chips & (chips - 1):
        raise ValueError(f"a slice of {chips} chips: standard slices are powers of two (name the shape: v5p:AxBxC)")
    shape = [1] * dims
    order = list(range(dims)) + list(reversed(range(dims)))
    for step in range(chips.bit_length() - 1):
        shape[order[step] if step < dims else order[dims + (step - dims) % dims]] *= 2
    return tuple(shape)


def parse_topology(name: str) -> Topology:
    """`v5p:4x4x2` (chips per axis, as libtpu names topologies) or `v5p-64` (the slice
    name Cloud TPU uses: TensorCores for v4 and v5p, chips for v5e and v6e)."""
    match = re.fullmatch(r"(v\d+[a-z]*)(?::(\d+(?:x\d+)+)|-(\d+))", name.strip())
    if match is None:
        raise ValueError(f"topology {name!r}: expected e.g. v5p-64, v5p:4x4x2, v6e-16 or v6e:4x4")
    generation, explicit, count = match.groups()
    chip = CHIPS.get(generation)
    if chip is None:
        raise ValueError(f"topology {name!r}: unknown TPU generation {generation!r}; known: {sorted(CHIPS)}")
    if explicit:
        shape = tuple(int(d) for d in explicit.split("x"))
        if len(shape) != chip.dims or min(shape) < 1:
            raise ValueError(f"topology {name!r}: {generation} slices have {chip.dims} positive dimensions")
        return Topology(chip, shape)
    units = int(count)
    if units % chip.cores_per_chip_in_name:
        raise ValueError(f"topology {name!r}: {generation}-N counts TensorCores, 2 per chip; N must be even")
    try:
        return Topology(chip, _grid(units // chip.cores_per_chip_in_name, chip.dims))
    except ValueError as exc:
        raise ValueError(f"topology {name!r}: {exc}") from None
