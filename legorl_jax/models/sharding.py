"""Device mesh and parameter partition rules.

Mesh axes: `data` (pure data parallel), `fsdp` (data parallel that also shards
parameters), `tensor` (heads / MLP width / vocab), `expert` (MoE experts).
Rules are matched on the parameter path; the leading stacked-layer axis is
never sharded so `lax.scan` slices a layer locally.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor", "expert")
BATCH_AXES = ("data", "fsdp")  # the batch dimension of activations is split over both

# (regex on "/".join(path), spec of the trailing dims; the layer axis is prepended for stacked params)
_RULES: tuple[tuple[str, tuple[str | None, ...]], ...] = (
    (r"^(embed_tokens|lm_head)/embedding$", ("tensor", "fsdp")),
    (r"norm/scale$", (None,)),
    # Linear weights are [out, in] (HF layout).
    (r"self_attn/[qkv]_proj/weight$", ("tensor", "fsdp")),
    (r"self_attn/[qkv]_proj/bias$", ("tensor",)),
    (r"self_attn/o_proj/weight$", ("fsdp", "tensor")),
    (r"self_attn/o_proj/bias$", (None,)),
    (r"mlp/(gate|up)_proj/weight$", ("tensor", "fsdp")),
    (r"mlp/(gate|up)_proj/bias$", ("tensor",)),
    (r"mlp/down_proj/weight$", ("fsdp", "tensor")),
    (r"mlp/down_proj/bias$", (None,)),
    (r"mlp/gate/weight$", (None, "fsdp")),
    # Stacked experts [expert, out, in].
    (r"mlp/(gate|up)_proj$", ("expert", "tensor", "fsdp")),
    (r"mlp/down_proj$", ("expert", "fsdp", "tensor")),
)


def make_mesh(
    data: int = 1, fsdp: int = -1, tensor: int = 1, expert: int = 1, devices: Sequence[jax.Device] | None = None
) -> Mesh:
    """A 4-axis mesh over `devices` (default: all of this job's); one axis may be -1 to take the rest."""
    sizes = [data, fsdp, tensor, expert]
    named = dict(zip(MESH_AXES, sizes, strict=True))
    n = len(devices) if devices is not None else jax.device_count()
    if sizes.count(-1) > 1 or any(s == 0 or s < -1 for s in sizes):
        raise ValueError(f"mesh sizes must be positive with at most one -1, got {named}")
    known = int(np.prod([s for s in sizes if s != -1]))
    if -1 in sizes:
        if n % known:
            raise ValueError(f"{n} devices are not divisible by the fixed mesh axes (product {known})")
        sizes[sizes.index(-1)] = n // known
    if int(np.prod(sizes)) != n:
        named = dict(zip(MESH_AXES, sizes, strict=True))
        raise ValueError(f"mesh {named} needs {int(np.prod(sizes))} devices, have {n}")
    # Auto axes: XLA propagates shardings through the model; explicit axes
    # would demand an out_sharding on every gather and einsum.
    auto = (AxisType.Auto,) * len(MESH_AXES)
    try:
        return jax.make_mesh(tuple(sizes), MESH_AXES, axis_types=auto, devices=devices)
    except NotImplementedError:
        # No whole physical axes make one of the sizes (fsdp 16 x tensor 4 on a v6e 8x8
        # torus): lay a mesh axis over part of a physical one, as jax does for v5e.
        grid = mesh_utils.create_device_mesh(
            tuple(sizes), list(devices) if devices is not None else jax.devices(), allow_split_physical_axes=True
        )
        return Mesh(grid, MESH_AXES, axis_types=auto)


def partition_spec(path: tuple[str, ...], shape: tuple[int, ...], mesh: Mesh) -> PartitionSpec:
    """Spec for one parameter; an axis that does not divide its dim is dropped (replicated)."""
    key = "/".join(path)
    trailing: tuple[str | None, ...]
    if path[-1] in ("lora_a", "lora_b"):
        # An adapter follows its weight [out, in]: A [r, in] shards as the weight's input,
        # B [out, r] as its output; the rank axis is small and stays whole.
        out_axis, in_axis = _trailing("/".join((*path[:-1], "weight")))
        trailing = (None, in_axis) if path[-1] == "lora_a" else (out_axis, None)
    else:
        trailing = _trailing(key)
    spec = (None,) * (len(shape) - len(trailing)) + trailing
    return PartitionSpec(
        *(axis if axis is None or dim % mesh.shape[axis] == 0 else None for axis, dim in zip(spec, shape, strict=True))
    )


def _trailing(key: str) -> tuple[str | None, ...]:
    trailing = next((spec for pattern, spec in _RULES if re.search(pattern, key)), None)
    if trailing is None:
        raise KeyError(f"no partition rule for parameter {key!r}")
    return trailing


def param_sharding(path: tuple[str, ...], shape: tuple[int, ...], mesh: Mesh | None) -> jax.sharding.Sharding:
    if mesh is None:
        return jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return NamedSharding(mesh, partition_spec(path, shape, mesh))


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Sharding of token batches [B, T]: rows split over data and fsdp."""
    return NamedSharding(mesh, PartitionSpec(BATCH_AXES, None))
