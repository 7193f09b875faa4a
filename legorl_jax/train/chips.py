"""Accelerators as `legorl plan` needs them: published per-chip peaks, and slice
names turned into the topologies XLA compiles for without the hardware.

TPU peaks are Google Cloud's published figures per chip (bf16 dense FLOP/s, HBM
capacity and bandwidth, bidirectional ICI bandwidth), from the system-architecture
page of each generation: https://cloud.google.com/tpu/docs/v4, .../v5e, .../v5p,
.../v6e (read 2026-12; v4's page gives ICI as 2,400 Gbps one way).
The H100's are NVIDIA's for the SXM part (bf16 dense, i.e. half the datasheet's
"with sparsity" figure; 80 GB HBM3 at 3.35 TB/s; NVLink 900 GB/s within a host,
and a 400 Gb/s InfiniBand NIC per GPU between hosts, as HGX H100 systems ship):
https://www.nvidia.com/en-us/data-center/h100/ (read 2026-12).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

GIB = 2**30


@dataclass(frozen=True)
class Chip:
    generation: str  # as libtpu names it in a topology (v4, v5e, v5p, v6e), or the GPU's (h100)
    bf16_flops: float  # peak dense bf16 FLOP/s per chip
    hbm_bytes: int  # HBM per chip
    hbm_bandwidth: float  # bytes/s per chip
    dims: int  # topology dimensions (3: a torus of chips, 2: a 2D slice; GPUs: hosts x GPUs)
    cores_per_chip_in_name: int  # how a slice name counts: TensorCores (v4, v5p) or chips
    link_bandwidth: float  # bytes/s per chip to its peers, both ways together (ICI; NVLink)
    platform: str = "tpu"  # the JAX platform that compiles for it: "tpu" or "gpu"
    host_link_bandwidth: float = 0.0  # GPUs: bytes/s per chip to other hosts, both ways (0: ICI spans them)


CHIPS = {
    "v4": Chip("v4", 275e12, 32 * GIB, 1200e9, 3, 2, 600e9),
    "v5e": Chip("v5e", 197e12, 16 * GIB, 819e9, 2, 1, 400e9),
    "v5p": Chip("v5p", 459e12, 95 * GIB, 2765e9, 3, 2, 1200e9),
    "v6e": Chip("v6e", 918e12, 32 * GIB, 1640e9, 2, 1, 800e9),
    "h100": Chip("h100", 989e12, 80 * 10**9, 3350e9, 2, 1, 900e9, platform="gpu", host_link_bandwidth=100e9),
}
GPUS_PER_HOST = 8  # an HGX/DGX H100 node; a GPU slice of more is whole nodes


@dataclass(frozen=True)
class Topology:
    chip: Chip
    shape: tuple[int, ...]  # chips along each axis

    @property
    def name(self) -> str:
        return f"{self.chip.generation}:{'x'.join(map(str, self.shape))}"

    @property
    def platform(self) -> str:
        return self.chip.platform

    @property
    def link_bandwidth(self) -> float:
        """Bytes/s each chip exchanges with the slice's others (both ways): across GPU hosts, the NIC's."""
        if self.chip.host_link_bandwidth and self.shape[0] > 1:
            return self.chip.host_link_bandwidth
        return self.chip.link_bandwidth

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
    name Cloud TPU uses: TensorCores for v4 and v5p, chips for v5e and v6e); GPUs by
    count, `h100-8` (one 8-GPU host) or `h100-64` (eight), or as `h100:8x8` (hosts x GPUs)."""
    match = re.fullmatch(r"(v\d+[a-z]*|h\d+)(?::(\d+(?:x\d+)+)|-(\d+))", name.strip())
    if match is None:
        raise ValueError(f"topology {name!r}: expected e.g. v5p-64, v5p:4x4x2, v6e-16, v6e:4x4 or h100-8")
    generation, explicit, count = match.groups()
    chip = CHIPS.get(generation)
    if chip is None:
        raise ValueError(f"topology {name!r}: unknown accelerator {generation!r}; known: {sorted(CHIPS)}")
    if explicit:
        shape = tuple(int(d) for d in explicit.split("x"))
        if len(shape) != chip.dims or min(shape) < 1:
            raise ValueError(f"topology {name!r}: {generation} slices have {chip.dims} positive dimensions")
        return Topology(chip, shape)
    units = int(count)
    if chip.platform == "gpu":
        if units < 1 or (units > GPUS_PER_HOST and units % GPUS_PER_HOST):
            raise ValueError(f"topology {name!r}: up to {GPUS_PER_HOST} GPUs, or whole hosts of {GPUS_PER_HOST}")
        return Topology(chip, (max(1, units // GPUS_PER_HOST), min(units, GPUS_PER_HOST)))
    if units % chip.cores_per_chip_in_name:
        raise ValueError(f"topology {name!r}: {generation}-N counts TensorCores, 2 per chip; N must be even")
    try:
        return Topology(chip, _grid(units // chip.cores_per_chip_in_name, chip.dims))
    except ValueError as exc:
        raise ValueError(f"topology {name!r}: {exc}") from None
