"""Orbax checkpoints of the learner: parameters, optimizer state, RNG, step,
policy version and the trainer's data/rollout cursor.

Saves go through one `CheckpointManager` (async when configured, keep-N,
every-K steps). Multi-host: every process calls `save` with the same step —
each writes the shards its devices hold and Orbax's primary process writes the
metadata — while the one decision that is not a pure function of the step (a
forced save, e.g. on pre-emption) is taken by process 0 and broadcast, so no
process waits forever on a save the others skipped.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from legorl_jax.core.config import CheckpointConfig
from legorl_jax.train.step import Learner


class CheckpointMismatch(ValueError):
    """A checkpoint that this run's learner cannot take up (it trained other parameters)."""


@dataclass(frozen=True)
class RestoredState:
    step: int
    policy_version: int
    rng: jax.Array
    cursor: dict[str, Any] = field(default_factory=dict)


def _agree(flag: bool) -> bool:
    if jax.process_count() == 1:
        return flag
    return bool(multihost_utils.broadcast_one_to_all(np.asarray(flag)))


class Checkpointer:
    def __init__(self, directory: str | Path, cfg: CheckpointConfig) -> None:
        self.directory = Path(directory).resolve()
        self.manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=cfg.keep,
                save_interval_steps=cfg.every_steps,
                enable_async_checkpointing=cfg.async_save,
                create=True,
                # A save cut short leaves a `<step>.orbax-checkpoint-tmp-*` directory that restores never
                # read (they take finished steps only); removed before the first save of a resumed run.
                cleanup_tmp_directories=True,
            ),
        )

    def save(
        self,
        learner: Learner,
        *,
        policy_version: int,
        rng: jax.Array,
        cursor: dict[str, Any] | None = None,
        force: bool = False,
    ) -> bool:
        """Saves at `learner.step` when the every-K policy (or `force`) says so.

        Returns whether a save started; with async saves it completes in the
        background (`wait()` blocks until it is on disk).
        """
        meta = {
            "step": learner.step,
            "policy_version": int(policy_version),
            "cursor": cursor or {},
            "lora": learner.lora_spec,
        }
        args = ocp.args.Composite(
            params=ocp.args.StandardSave(learner.params),
            opt_state=ocp.args.StandardSave(learner.opt_state),
            # On the host: a device key is local to one process, which Orbax cannot save across several.
            rng=ocp.args.StandardSave({"key_data": np.asarray(jax.random.key_data(rng))}),
            meta=ocp.args.JsonSave(meta),
        )
        return self.manager.save(learner.step, args=args, force=_agree(force))

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def restore_latest(self, learner: Learner, rng_impl: str | None = None) -> RestoredState | None:
        """Loads the newest checkpoint into `learner` (placed per its shardings);
        None when the directory holds none."""
        step = self.manager.latest_step()
        if step is None:
            return None
        abstract = lambda tree, sh: jax.tree.map(  # noqa: E731
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, sh
        )
        saved = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        if saved.get("lora") != learner.lora_spec:
            trained = lambda spec: f"LoRA adapters {spec}" if spec else "every weight"  # noqa: E731
            raise CheckpointMismatch(
                f"the checkpoint at step {step} trained {trained(saved.get('lora'))} and this run's model.lora "
                f"trains {trained(learner.lora_spec)}: set model.lora as the run that saved it had it"
            )
        restored = self.manager.restore(
            step,
            args=ocp.args.Composite(
                params=ocp.args.StandardRestore(abstract(learner.params, learner.param_sh)),
                opt_state=ocp.args.StandardRestore(abstract(learner.opt_state, learner.opt_sh)),
                rng=ocp.args.StandardRestore(),
                meta=ocp.args.JsonRestore(),
            ),
        )
        meta = restored["meta"]
        learner.params, learner.opt_state, learner.step = restored["params"], restored["opt_state"], int(meta["step"])
        key = jax.random.wrap_key_data(jnp.asarray(restored["rng"]["key_data"]), impl=rng_impl)
        return RestoredState(int(meta["step"]), int(meta["policy_version"]), key, dict(meta["cursor"]))

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.close()
