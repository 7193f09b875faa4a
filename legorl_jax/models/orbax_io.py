"""Model parameters in Orbax checkpoints laid out like the learner's.

`legorl_jax.train.checkpoint` saves each step as an Orbax composite whose
`params` item is the pure dict of the model's `nnx.Param` state. This module
reads (and writes) just that item, so a training checkpoint can be exported
to HF and an HF model can seed an Orbax params checkpoint.
"""

from __future__ import annotations

import os
from pathlib import Path

import jax
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import Mesh

from legorl_jax.models.config import ModelConfig
from legorl_jax.models.hf_io import CheckpointError, abstract_model
from legorl_jax.models.sharding import param_sharding
from legorl_jax.models.transformer import CausalLM


def save_params(model: CausalLM, directory: str | os.PathLike[str], *, step: int = 0) -> Path:
    """Write the model's parameters as step `step` of an Orbax checkpoint directory."""
    directory = Path(directory).resolve()
    params = nnx.state(model, nnx.Param).to_pure_dict()
    with ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(create=True)) as manager:
        manager.save(step, args=ocp.args.Composite(params=ocp.args.StandardSave(params)), force=True)
        manager.wait_until_finished()
    return directory


def load_params(
    directory: str | os.PathLike[str], config: ModelConfig, *, step: int | None = None, mesh: Mesh | None = None
) -> CausalLM:
    """A `CausalLM` for `config` with parameters from an Orbax checkpoint (latest step by default)."""
    directory = Path(directory).resolve()
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: not a checkpoint directory")
    graphdef, state = nnx.split(abstract_model(config))
    target = jax.tree.map(
        lambda x, path: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=param_sharding(path, x.shape, mesh)),
        state.to_pure_dict(),
        _paths(state.to_pure_dict()),
    )
    with ocp.CheckpointManager(directory) as manager:
        step = manager.latest_step() if step is None else step
        if step is None or step not in manager.all_steps():
            raise CheckpointError(f"{directory}: no checkpoint step {step} (have {manager.all_steps()})")
        restored = manager.restore(step, args=ocp.args.Composite(params=ocp.args.StandardRestore(target)))
    nnx.replace_by_pure_dict(state, restored["params"])
    return nnx.merge(graphdef, state)


def _paths(tree: dict) -> dict:
    """The same nested dict with each leaf replaced by its key path (a tuple of str)."""
    return jax.tree_util.tree_map_with_path(lambda kp, _: tuple(str(k.key) for k in kp), tree)
