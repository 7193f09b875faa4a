"""Shardings of the learner's state and batches over the (data, fsdp, tensor,
expert) mesh.

Parameters follow the model's partition rules; optimizer moments mirror the
parameters they track; scalars (step counts) are replicated; batches split their
row axis over data × fsdp. Host batches become global arrays through
`make_array_from_callback`, so on a multi-host mesh every process hands over
only the shards its own devices hold.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from legorl_jax.core.config import MeshConfig
from legorl_jax.models import batch_sharding, make_mesh, partition_spec

Params = dict[str, Any]  # nested dict of arrays, the pure-dict form of nnx.State


def learner_mesh(cfg: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """The configured mesh over `devices` (default: all global ones), with Auto axis types.

    jax.make_mesh defaults to Explicit axes (sharding in types), under which
    every gather in the model would need an explicit out_sharding; with Auto
    axes the explicit shardings sit on the step's inputs/outputs and XLA's
    propagation places the activations.
    """
    explicit = make_mesh(cfg.data, cfg.fsdp, cfg.tensor, cfg.expert, devices=devices)
    return Mesh(explicit.devices, explicit.axis_names, axis_types=(AxisType.Auto,) * len(explicit.axis_names))


def data_parallel_size(mesh: Mesh) -> int:
    return int(mesh.shape["data"] * mesh.shape["fsdp"])


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def param_shardings(params: Params, mesh: Mesh) -> Params:
    """NamedSharding per parameter (a pure dict, as `nnx.State.to_pure_dict()`),
    from the model's partition rules."""

    def one(path: tuple[Any, ...], x: Any) -> NamedSharding:
        names = tuple(str(getattr(k, "key", k)) for k in path)
        return NamedSharding(mesh, partition_spec(names, x.shape, mesh))

    return jax.tree_util.tree_map_with_path(one, params)


def like_params(tree: Any, params: Params, shardings: Params, mesh: Mesh) -> Any:
    """Shardings for a pytree (e.g. optimizer state) whose param-shaped subtrees
    take the parameters' shardings and whose other leaves are replicated."""
    param_def: Any = jax.tree.structure(params)  # jaxlib ships no type stub for PyTreeDef

    def is_param_tree(x: Any) -> bool:
        return jax.tree.structure(x) == param_def

    return jax.tree.map(lambda sub: shardings if is_param_tree(sub) else replicated(mesh), tree, is_leaf=is_param_tree)


def put_batch(arrays: dict[str, np.ndarray], mesh: Mesh) -> dict[str, jax.Array]:
    """Host arrays (identical on every process) → global arrays split by rows."""
    sharding = batch_sharding(mesh)
    return {k: jax.make_array_from_callback(v.shape, sharding, v.__getitem__) for k, v in arrays.items()}
