"""Orbax checkpoints of the learner: parameters, optimizer state, RNG, step,
policy version and the trainer's data/rollout cursor.

Saves go through one `CheckpointManager` (async when configured, keep-N,
every-K steps). Multi-host: every process calls `save` with the same step —
each writes the shards its devices hold and Orbax's primary process writes the
metadata — while the one decision that is not a pure function of the step (a
forced save, e.g. on pre-emption) is taken by process 0 and broadcast, so no
process waits forever on a save the others skipped.

The directory is a local path or a `gs://bucket/prefix` URL (`checkpoint_root`): on GCS Orbax writes a
step in place and marks it finished with a `commit_success.txt` (no atomic rename there), and lists only
finished steps, so a save cut short is never restored.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from legorl_jax.core.config import CheckpointConfig
from legorl_jax.core.errors import InputError
from legorl_jax.models.orbax_io import checkpoint_root
from legorl_jax.train.step import Learner


class CheckpointMismatch(ValueError, InputError):
    """A checkpoint that this run's learner cannot take up (it trained other parameters)."""


class CheckpointSaveError(RuntimeError):
    """A save that did not finish (storage gone, a write refused): the step is not restorable."""


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
    def __init__(self, directory: str | os.PathLike[str], cfg: CheckpointConfig) -> None:
        try:
            self.directory = checkpoint_root(directory)
        except ValueError as exc:
            raise ValueError(f"checkpoint directory: {exc}") from None
        self.async_save = cfg.async_save
        self._started: int | None = None  # the step of the last save started
        self.manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=cfg.keep,
                save_interval_steps=cfg.every_steps,
                enable_async_checkpointing=cfg.async_save,
                create=True,
                # A save cut short leaves a `<step>.orbax-checkpoint-tmp-*` directory that restores never
                # read (they take finished steps only); removed before the first save of a resumed run. On
                # gs:// it leaves `<step>` without its commit_success.txt, never restored either, and
                # written over when the resumed run saves that step.
                cleanup_tmp_directories=True,
                # Created in the background, a step directory the storage fails to create (a bucket gone)
                # leaves the save waiting on a signal that never comes, then a bare TimeoutError. Created
                # by `save` itself, before the async part, the storage's own error comes at `wait`.
                async_options=ocp.AsyncOptions(create_directories_asynchronously=False),
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
        force = _agree(force)
        which = f"step {learner.step}"
        if self.async_save and self._started is not None:
            # Orbax raises an async save's failure at the next save.
            which += f" or the async save of step {self._started} before it"
        with self._saving(which):
            started = self.manager.save(learner.step, args=args, force=force)
        self._started = learner.step if started else self._started
        return started

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
        with self._saving(f"step {self._started}"):
            self.manager.wait_until_finished()

    @contextmanager
    def _saving(self, which: str) -> Iterator[None]:
        """Names the directory and the step in a save's failure: Orbax raises the storage client's bare
        error (a connection refused, with no path)."""
        try:
            yield
        except Exception as exc:
            raise CheckpointSaveError(
                f"{self.directory}: the checkpoint of {which} did not finish ({type(exc).__name__}: {exc}); "
                "a resumed run restores the last finished checkpoint"
            ) from exc

    def close(self) -> None:
        self.manager.close()
