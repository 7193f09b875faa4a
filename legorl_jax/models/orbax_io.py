"""Model parameters in Orbax checkpoints laid out like the learner's.

`legorl_jax.train.checkpoint` saves each step as an Orbax composite whose
`params` item is the pure dict of the model's `nnx.Param` state. This module
reads (and writes) just that item, so a training checkpoint can be exported
to HF and an HF model can seed an Orbax params checkpoint. A LoRA run's `params`
are its adapters alone, and its `meta` item says their settings (`saved_lora`):
`load_adapters` puts them back onto the base model.
"""

from __future__ import annotations

import os
from pathlib import Path

import jax
import orbax.checkpoint as ocp
from etils import epath
from flax import nnx
from jax.sharding import Mesh

from legorl_jax.core.storage_location import checked_location, is_gcs
from legorl_jax.models.config import ModelConfig
from legorl_jax.models.hf_io import CheckpointError, abstract_model
from legorl_jax.models.lora import add_adapters
from legorl_jax.models.sharding import param_sharding
from legorl_jax.models.transformer import CausalLM


def checkpoint_root(location: str | os.PathLike[str]) -> epath.Path:
    """A checkpoint directory as Orbax takes it: a gs:// URL stays one (etils reaches it through gcsfs,
    the arrays go through tensorstore), a local path is made absolute. ValueError for a malformed URL."""
    checked = checked_location(os.fspath(location))
    return epath.Path(checked) if is_gcs(checked) else epath.Path(Path(checked).resolve())


def save_params(model: CausalLM, directory: str | os.PathLike[str], *, step: int = 0) -> epath.Path:
    """Write the model's parameters as step `step` of an Orbax checkpoint directory."""
    root = checkpoint_root(directory)
    params = nnx.state(model, nnx.Param).to_pure_dict()
    with ocp.CheckpointManager(root, options=ocp.CheckpointManagerOptions(create=True)) as manager:
        manager.save(step, args=ocp.args.Composite(params=ocp.args.StandardSave(params)), force=True)
        manager.wait_until_finished()
    return root


def load_params(
    directory: str | os.PathLike[str], config: ModelConfig, *, step: int | None = None, mesh: Mesh | None = None
) -> CausalLM:
    """A `CausalLM` for `config` with parameters from an Orbax checkpoint (latest step by default)."""
    root = checkpoint_root(directory)
    if not root.is_dir():
        raise CheckpointError(f"{root}: not a checkpoint directory")
    graphdef, state = nnx.split(abstract_model(config))
    target = jax.tree.map(
        lambda x, path: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=param_sharding(path, x.shape, mesh)),
        state.to_pure_dict(),
        _paths(state.to_pure_dict()),
    )
    nnx.replace_by_pure_dict(state, _restore_params(root, target, step))
    return nnx.merge(graphdef, state)


def saved_lora(directory: str | os.PathLike[str], *, step: int | None = None) -> dict | None:
    """The adapters' settings a learner checkpoint recorded ({"rank", "alpha", "targets"}), or
    None: a full model's checkpoint, or a params-only one (`save_params`)."""
    root = checkpoint_root(directory)
    if not root.is_dir():
        raise CheckpointError(f"{root}: not a checkpoint directory")
    with ocp.CheckpointManager(root) as manager:
        step = _step(manager, root, step)
        if not (root / str(step) / "meta").is_dir():
            return None
        meta = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    return meta.get("lora")


def load_adapters(
    directory: str | os.PathLike[str], base: CausalLM, *, step: int | None = None, mesh: Mesh | None = None
) -> CausalLM:
    """`base` (the run's starting model) with the adapters of a LoRA run's checkpoint."""
    spec = saved_lora(directory, step=step)
    if spec is None:
        raise CheckpointError(f"{directory}: not a LoRA run's checkpoint (its meta records no adapters)")
    add_adapters(base, rank=spec["rank"], alpha=spec["alpha"], targets=spec["targets"], seed=0, mesh=mesh)
    state = nnx.state(base, nnx.LoRAParam)
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state.to_pure_dict())
    nnx.replace_by_pure_dict(state, _restore_params(checkpoint_root(directory), target, step))
    nnx.update(base, state)
    return base


def _step(manager: ocp.CheckpointManager, directory: epath.Path, step: int | None) -> int:
    chosen = manager.latest_step() if step is None else step
    if chosen is None or chosen not in manager.all_steps():
        raise CheckpointError(f"{directory}: no checkpoint step {chosen} (have {manager.all_steps()})")
    return chosen


def _restore_params(directory: epath.Path, target: dict, step: int | None) -> dict:
    with ocp.CheckpointManager(directory) as manager:
        chosen = _step(manager, directory, step)
        return manager.restore(chosen, args=ocp.args.Composite(params=ocp.args.StandardRestore(target)))["params"]


def _paths(tree: dict) -> dict:
    """The same nested dict with each leaf replaced by its key path (a tuple of str)."""
    return jax.tree_util.tree_map_with_path(lambda kp, _: tuple(str(k.key) for k in kp), tree)
